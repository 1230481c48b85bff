"""A caption longer than the transformer can take (200k characters) is quarantined by encode-text with the reason,
so nothing unusable reaches the `text` table (before, it crashed train in the RoPE table)."""

from __future__ import annotations

from typer.testing import CliRunner

from models.multires import text_positions_left
from pipeline.cli import app
from store import Store


def test_text_positions_follow_the_stock_rope_table():
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    table = QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True).pos_freqs.shape[0]
    assert text_positions_left([]) == table
    assert text_positions_left([[1, 64, 32], [1, 20, 90]]) == table - 45  # text starts after the largest extent


def test_a_caption_too_long_is_quarantined_at_encode_text(tiny_edit_model, tmp_path, images_fixture):
    fx = images_fixture
    samples = fx.edit_samples()[:2] + [fx.Sample("make it blue " * 16000, (64, 64), [(64, 64)], [(64, 64)])]
    keys = list(fx.write(tmp_path / "s", samples))
    r = CliRunner().invoke(app, ["run", "encode-text", "--store", str(tmp_path / "s"), "--model", tiny_edit_model,
                                 "--device", "cpu"])
    assert r.exit_code == 0, r.output
    st = Store(tmp_path / "s")
    assert sorted(st.reader("text").keys()) == sorted(keys[:2])
    rows = {q["key"]: q for q in st.quarantine().to_pylist() if q["stage"] == "encode-text"}
    assert rows[keys[2]]["reason"] == "caption too long"
    assert "text positions" in rows[keys[2]]["detail"] and "shorten the caption" in rows[keys[2]]["detail"]


def test_a_caption_of_megabytes_is_quarantined_without_tokenizing_it(tiny_edit_model, tmp_path, images_fixture,
                                                                      monkeypatch):
    """A 3 MB caption (20 MB ones took the tokenizer minutes and gigabytes) is refused from its length: the
    tokenizer never sees it; the same reason as a tokenized one."""
    from transformers import PreTrainedTokenizerBase

    longest, real = [0], PreTrainedTokenizerBase.__call__

    def measured(self, text=None, *args, **kwargs):
        longest[0] = max([longest[0], *(len(t) for t in ([text] if isinstance(text, str) else text or ()))])
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", measured)
    fx = images_fixture
    samples = fx.edit_samples()[:1] + [fx.Sample("make it blue " * 240_000, (64, 64), [(64, 64)], [(64, 64)])]
    keys = list(fx.write(tmp_path / "s", samples))
    r = CliRunner().invoke(app, ["run", "encode-text", "--store", str(tmp_path / "s"), "--model", tiny_edit_model,
                                 "--device", "cpu"])
    assert r.exit_code == 0, r.output
    rows = {q["key"]: q for q in Store(tmp_path / "s").quarantine().to_pylist() if q["stage"] == "encode-text"}
    assert rows[keys[1]]["reason"] == "caption too long" and "not tokenized" in rows[keys[1]]["detail"]
    assert 0 < longest[0] < 100_000  # the other sample's prompts were tokenized; the 3 MB caption never was


def test_the_token_bound_from_bytes_never_exceeds_the_tokenizers_count(tiny_edit_model):
    """`least_caption_tokens` is a lower bound whatever the text: runs the tokenizer merges most (spaces, repeated
    punctuation), Hangul jamo NFC composes, special tokens spelled out, emoji."""
    from transformers import AutoTokenizer

    from stages.encode.intake import least_caption_tokens

    tok = AutoTokenizer.from_pretrained(tiny_edit_model, subfolder="tokenizer")
    texts = [" " * 20_000, "=" * 20_000, "-" * 20_000, "\n" * 20_000, "\u1100\u1161\u11a8" * 5_000,
             "e\u0323\u0302" * 5_000, "<|im_start|><|endoftext|>" * 2_000, "\U0001F600" * 5_000,
             "make it blue " * 5_000, "".join(chr(c) for c in range(0x20, 0x3000)) * 2]
    for text in texts:
        assert 0 < least_caption_tokens(text, tok) <= len(tok(text)["input_ids"]), text[:20]


class _NotToBeTaken:
    """A lock that refuses to be taken: what must run without the tokenizer's lock."""

    def __enter__(self):
        raise AssertionError("the tokenizer lock was taken")

    def __exit__(self, *exc):
        return False


def test_the_vocabulary_is_read_once_under_the_lock_then_no_sample_waits_for_it(tiny_edit_model, monkeypatch):
    """encode-text's threads read the tokenizer's vocabulary once (the fast tokenizer is not safe to call from two
    threads at once: under the lock, and only one of the threads that race on the first read); afterwards a
    hopeless caption is refused without taking the lock (before, every sample waited for it behind the other
    threads' tokenizing)."""
    import threading

    from models.loading import load_component
    from stages.encode.text import prepare, prompt_format

    processor = load_component(tiny_edit_model, "processor")  # a tokenizer of its own: its vocabulary unread
    fmt, lock, reads, barrier = prompt_format("edit", None, None), threading.Lock(), [], threading.Barrier(8)
    real = processor.tokenizer.get_vocab

    def read_under_the_lock():
        reads.append(lock.locked())
        return real()

    monkeypatch.setattr(processor.tokenizer, "get_vocab", read_under_the_lock)
    sample = {"meta": {"num_controls": 1, "caption": "make it blue " * 240_000}, "files": {}}
    verdicts = [None] * 8

    def one(i: int) -> None:
        barrier.wait()  # all eight reach the cold cache together
        verdicts[i] = prepare(f"k{i}", sample, fmt, processor, lock)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reads == [True]  # one read, under the lock
    assert [v.reason for v in verdicts] == ["caption too long"] * 8 and "not tokenized" in verdicts[0].detail
    warm = prepare("k", sample, fmt, processor, _NotToBeTaken())
    assert warm.reason == "caption too long" and warm.detail == verdicts[0].detail
