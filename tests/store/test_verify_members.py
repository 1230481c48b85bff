"""`store verify`'s tar member walk reads the writer's plain headers itself and leaves every other header to
`tarfile.TarInfo.frombuf`: the members it finds are frombuf's, header by header."""

from __future__ import annotations

import io
import tarfile

from store.verify import _members, _plain_header


def _frombuf(block: bytes) -> tuple[str, int] | None:
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "strict")
    except (tarfile.TarError, UnicodeDecodeError):
        return None
    return info.name, info.size


def _header(name: str, size: int = 5, fmt: int = tarfile.USTAR_FORMAT, **attrs) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    for k, v in attrs.items():
        setattr(info, k, v)
    return info.tobuf(fmt, "utf-8", "strict")


def _blocks() -> list[bytes]:
    plain = _header("0123abcd.safetensors")
    bad_sum = bytearray(plain)
    bad_sum[0] ^= 1
    spaced = bytearray(plain)
    spaced[124:136] = b"   5 5     \0"  # not one number
    devmajor = bytearray(plain)  # a field tarfile refuses, under a checksum that matches
    devmajor[329:337] = b"zz\0\0\0\0\0\0"
    devmajor[148:156] = b"%06o\0 " % (256 + sum(devmajor) - sum(devmajor[148:156]))
    return [
        plain, _header("k.target.png", 123456), _header("d/" * 60 + "k.json"),  # a prefix (long path)
        _header("x" * 120, fmt=tarfile.GNU_FORMAT)[:512],  # a GNU long-name header ('L')
        _header("x" * 120, fmt=tarfile.PAX_FORMAT)[:512],  # a pax header
        _header("big", 2**34, fmt=tarfile.GNU_FORMAT),  # base-256 size
        _header("dir/", type=tarfile.AREGTYPE), _header("d", type=tarfile.DIRTYPE),
        _header("k.json", uname="é"), bytes(bad_sum), bytes(spaced), bytes(devmajor), bytes(512), plain[:300],
    ]


def test_every_header_reads_as_tarfile_reads_it():
    for block in _blocks():
        got = _plain_header(block)
        assert got is None or got == _frombuf(block), block[:100]
    assert _plain_header(_blocks()[0]) == ("0123abcd.safetensors", 5)  # the writer's headers take the fast path
    assert _frombuf(_blocks()[-3]) is None and _plain_header(_blocks()[-3]) is None  # the devmajor block
    assert _plain_header(_blocks()[2]) == ("d/" * 60 + "k.json", 5)


def _walk(data: bytes, base: int) -> dict[str, tuple[int, int]] | None:
    """The walk with frombuf for every header (verify's before the fast path)."""
    out, pos = {}, 0
    while pos < len(data):
        try:
            info = tarfile.TarInfo.frombuf(data[pos : pos + 512], "utf-8", "strict")
        except tarfile.TarError:
            return None
        out[info.name] = (base + pos + 512, info.size)
        pos += 512 + info.size + (-info.size % 512)
    return out if pos == len(data) else None


def test_members_of_a_sample_as_frombuf_finds_them():
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            for name, n in (("k.safetensors", 700), ("k.target.png", 3), ("d/" * 60 + "k.png", 10), ("k.json", 0)):
                info = tarfile.TarInfo(name)
                info.size = n
                tar.addfile(info, io.BytesIO(bytes(n)))
            end = tar.offset
        data = buf.getvalue()[:end]
        assert _members(data, 1000) == _walk(data, 1000) is not None
        assert _members(data[:-1], 1000) is None  # cut short: not whole members
        if fmt == tarfile.USTAR_FORMAT:  # the members tarfile lists (pax / GNU long names: their own headers too)
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                assert {m.name: (1000 + m.offset_data, m.size) for m in tar.getmembers()} == _members(data, 1000)


def test_a_member_name_that_is_not_utf8_is_not_whole_members():
    """A header with a valid checksum whose name is not UTF-8 (no writer of ours makes one): the sample's bytes
    are refused as not whole members. Before: tarfile's UnicodeDecodeError escaped the walk, a traceback."""
    info = tarfile.TarInfo("k\xff.png")
    info.size = 3
    header = info.tobuf(tarfile.USTAR_FORMAT, "latin-1", "strict")
    data = header + b"abc" + b"\0" * (tarfile.BLOCKSIZE - 3)
    assert _members(data, 0) is None
