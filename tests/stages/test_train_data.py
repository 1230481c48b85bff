"""Train inputs: table validation errors, v1 tables, manifest-only lengths, per-sample randomness, `flow_loss`
against the unmodified diffusers transformer run on each sample alone."""

from __future__ import annotations

from math import prod

import pytest
import torch

from models.multires import pack_latents
from schemas.config import SigmaConfig
from schemas import UserError
from models.flow import flow_loss
from models.randomness import draw_caption_dropout, draw_noise, draw_sigma
from models.sample import from_features
from stages.train.data import load
from store import TableReader
from train_store import Spec, key_of, make_train_store, mixed_specs, open_split as open_train_tables


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory, tiny_edit_model):
    root = tmp_path_factory.mktemp("train-data") / "store"
    make_train_store(root, tiny_edit_model, mixed_specs(6, 2, masks=True))
    return root


@pytest.fixture(scope="module")
def tables(store_dir, tiny_edit_model):
    return open_train_tables(store_dir, tiny_edit_model)


@pytest.fixture(scope="module")
def stock_transformer(tiny_edit_model):
    from models.loading import load_component

    return load_component(tiny_edit_model, "transformer", dtype=torch.float32)


@pytest.fixture(scope="module")
def multires_transformer(tiny_edit_model):
    from models.loading import load_component
    from models.multires import install_multires

    t = load_component(tiny_edit_model, "transformer", dtype=torch.float32)
    install_multires(t)
    return t


# ---------------------------------------------------------------------------------------------- validation


def test_opens_train_split_with_lengths_from_manifests_only(store_dir, tiny_edit_model, monkeypatch):
    def no_tensor_reads(self, key):
        raise AssertionError("lengths must come from the manifests")

    monkeypatch.setattr(TableReader, "tensors", no_tensor_reads)
    t = open_train_tables(store_dir, tiny_edit_model)
    specs = mixed_specs(6, 2)
    assert t.keys == sorted(key_of(i) for i in range(6))
    by_key = {key_of(i): s for i, s in enumerate(specs)}
    want = [sum((h // 2) * (w // 2) for h, w in [by_key[k].target, *by_key[k].controls]) + by_key[k].text_len
            for k in t.keys]
    assert t.lengths.tolist() == want
    assert set(t.versions()) == {"text", "vae"}


def test_missing_table_is_a_user_error(tmp_path, tiny_edit_model):
    from store import Store

    Store(tmp_path / "s")
    with pytest.raises(UserError, match=r"no 'text' table.*pipeline run encode-text --store \S+ --model \S+` first"):
        open_train_tables(tmp_path / "s", tiny_edit_model)  # a command that runs as suggested: --model included


def test_empty_train_split_is_a_user_error(tmp_path, tiny_edit_model):
    make_train_store(tmp_path / "s", tiny_edit_model, [Spec((4, 4), split="val")])
    with pytest.raises(UserError, match="'train' split is empty"):
        open_train_tables(tmp_path / "s", tiny_edit_model)


def test_tables_from_another_model_are_refused(tmp_path, tiny_edit_model):
    make_train_store(tmp_path / "s", tiny_edit_model, mixed_specs(2), fingerprint="0123456789abcdef")
    with pytest.raises(UserError, match=r"table 'text' v1 .* different model \(fingerprint 0123456789abcdef\)"):
        open_train_tables(tmp_path / "s", tiny_edit_model)


def test_mismatched_keys_train_on_the_intersection_or_fail_above_the_threshold(tmp_path, tiny_edit_model):
    make_train_store(tmp_path / "s", tiny_edit_model, mixed_specs(4), skip_text={1}, skip_vae={3})
    with pytest.raises(UserError) as e:  # 2 of 4 dropped: above the default 5%
        open_train_tables(tmp_path / "s", tiny_edit_model)
    msg = str(e.value)
    assert "2 of 4 samples (50.0%)" in msg and "encode-text: not encoded 1" in msg and "encode-vae: not encoded 1" in msg
    from models.loading import model_fingerprint
    from features.open import open_features

    t = open_features(tmp_path / "s", tiny_edit_model, model_fingerprint(tiny_edit_model), "train", 0.5)
    assert list(t.keys) == sorted(key_of(i) for i in (0, 2)) and t.report["dropped"] == 2
    assert t.report["only_in"] == {"text": 1, "vae": 1}


def test_the_dropped_report_reads_the_images_manifest_not_its_shards(tmp_path):
    """The report counts the split's samples from the `images` manifest (key, split) alone: a missing images
    shard (no stage after encode reads one) gives the same report. Before: a full images reader opened on every
    rank, stat'ing each shard; the missing one refused training (DamagedData) and was recorded as damage."""
    from features.open import open_features
    from schemas import FieldSpec, Lineage, TableSchema
    from store import format as fmt

    fp = "0123456789abcdef"
    st = make_train_store(tmp_path / "s", "m", mixed_specs(4, 2), fingerprint=fp, skip_vae={1})
    fields = [FieldSpec("target.png", "png", kind="file"), FieldSpec("split", "string", kind="column")]
    schema = TableSchema("images", fields, Lineage("resize-bucket", config_hash="t", upstream={}, code_version="t"))
    w = st.writer("images", schema, shard_size_mb=0.0001)  # a shard per sample
    for i in range(8):  # 6: in the train split, never encoded; 7: val
        w.add(key_of(i), files={"target.png": b"png"},
              meta={"split": "train" if i in (0, 1, 2, 3, 6) else "val", "img_shapes": [[1, 2, 2]]})
    assert w.commit() == 1
    st.add_quarantine([{"key": key_of(1), "source": "s", "stage": "encode-vae", "reason": "damaged-input"}])
    want = {"split": "train", "samples": 5, "joined": 3, "dropped": 2, "dropped_fraction": 0.4,
            "reasons": {"encode-vae": {"damaged-input": 1}, "encode-text/encode-vae": {"not encoded": 1}},
            "only_in": {"text": 1, "vae": 0}, "quarantine_file": str(st.root / fmt.QUARANTINE)}
    assert open_features(st.root, "m", fp, "train", 0.5).report == want
    shard = st.version_dir("images", 1) / st.reader("images").manifest.column("shard")[0].as_py()
    shard.unlink()
    assert open_features(st.root, "m", fp, "train", 0.5).report == want
    assert open_features(st.root, "m", fp, "val", 0.5).report["samples"] == 3
    assert not fmt.damaged_marker(st.root, "images", 1).exists()


def test_v1_tables_read_via_derived_img_shapes(tmp_path, tiny_edit_model):
    specs = [Spec((8, 12), [(12, 8)], 7), Spec((4, 8), [], 5), Spec((6, 6), [(4, 4)], 9)]
    make_train_store(tmp_path / "v1", tiny_edit_model, specs, schema_version=1)
    make_train_store(tmp_path / "v2", tiny_edit_model, specs, schema_version=2)
    t1, t2 = open_train_tables(tmp_path / "v1", tiny_edit_model), open_train_tables(tmp_path / "v2", tiny_edit_model)
    assert t1.text.is_v1 and not t2.text.is_v1
    assert t1.lengths.tolist() == t2.lengths.tolist()
    for k in t1.keys:
        a, b = load(t1, k), load(t2, k)
        assert a.img_shapes == b.img_shapes
        assert torch.equal(a.target, b.target) and len(a.controls) == len(b.controls)


# ---------------------------------------------------------------------------------------------- randomness


def test_per_sample_draws_depend_only_on_seed_step_key(tables):
    a, b = load(tables, tables.keys[0]), load(tables, tables.keys[1])
    assert torch.equal(draw_noise(a, 0, 5), draw_noise(a, 0, 5))
    assert not torch.equal(draw_noise(a, 0, 5), draw_noise(a, 0, 6))
    assert not torch.equal(draw_noise(a, 0, 5), draw_noise(a, 1, 5))
    assert draw_noise(a, 0, 5).shape == a.target.shape
    cfg = SigmaConfig(sampling="dynamic_shift")
    assert draw_sigma(a, 0, 3, cfg) == draw_sigma(a, 0, 3, cfg) != draw_sigma(b, 0, 3, cfg)
    drops = [draw_caption_dropout(a, 0, s, 0.5) for s in range(200)]
    assert 60 < sum(drops) < 140 and drops == [draw_caption_dropout(a, 0, s, 0.5) for s in range(200)]
    assert not any(draw_caption_dropout(a, 0, s, 0.0) for s in range(50))


# ---------------------------------------------------------------------------------------------- flow_loss


def _reference_loss(stock, sample, sigma, noise, prompt=None):
    """Unmodified diffusers transformer on one sample at batch 1: [target | controls] tokens, loss on target."""
    x0 = pack_latents(sample.target).float()
    eps = pack_latents(noise).float()
    x_t = (1 - sigma) * x0 + sigma * eps
    tokens = torch.cat([x_t] + [pack_latents(c).float() for c in sample.controls])[None]
    prompt = sample.prompt_embeds if prompt is None else prompt
    out = stock(
        hidden_states=tokens,
        encoder_hidden_states=prompt.float()[None],
        timestep=torch.tensor([sigma]),
        img_shapes=[sample.img_shapes],
        return_dict=False,
    )[0][0, : x0.shape[0]]
    return ((out - (eps - x0)) ** 2).mean(), ((out - (eps - x0)) ** 2).mean(dim=-1)


def test_flow_loss_matches_unmodified_transformer_per_sample(tables, stock_transformer, multires_transformer):
    samples = [load(tables, k) for k in tables.keys]
    assert len({tuple(s.img_shapes[0]) for s in samples}) > 2 and len({len(s.controls) for s in samples}) == 3
    sigmas = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.85, 0.95])
    noises = [draw_noise(s, 7, 0) for s in samples]
    with torch.no_grad():
        got = flow_loss(multires_transformer, samples, sigmas, noises)
        want = torch.stack([_reference_loss(stock_transformer, s, float(sg), n)[0]
                            for s, sg, n in zip(samples, sigmas, noises)])
    assert got.shape == (len(samples),) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_flow_loss_caption_dropout_and_mask_weighting(tables, stock_transformer, multires_transformer):
    samples = [load(tables, k) for k in tables.keys[:4]]
    masked = [s for s in samples if s.mask_weight is not None]
    assert masked and any(s.mask_weight is None for s in samples)
    sigmas = torch.full((4,), 0.4)
    noises = [draw_noise(s, 1, 2) for s in samples]
    with torch.no_grad():
        dropped = flow_loss(multires_transformer, samples, sigmas, noises, use_empty=[True, False, True, False])
        weighted = flow_loss(multires_transformer, samples, sigmas, noises, mask_weight=(3.0, 0.5))
        for i, s in enumerate(samples):
            plain, per_token = _reference_loss(stock_transformer, s, 0.4, noises[i],
                                               prompt=s.empty_embeds if i in (0, 2) else None)
            torch.testing.assert_close(dropped[i], plain, rtol=1e-5, atol=1e-6)
            _, per_token = _reference_loss(stock_transformer, s, 0.4, noises[i])
            if s.mask_weight is None:
                want = per_token.mean()
            else:
                w = 0.5 + 2.5 * s.mask_weight
                assert w.shape == per_token.shape == (prod(s.img_shapes[0]),)
                want = (w * per_token).sum() / w.sum()
            torch.testing.assert_close(weighted[i], want, rtol=1e-5, atol=1e-6)


def test_flow_loss_of_a_sample_does_not_depend_on_its_batch(tables, multires_transformer):
    samples = [load(tables, k) for k in tables.keys]
    sigmas = torch.linspace(0.2, 0.8, len(samples))
    noises = [draw_noise(s, 3, 1) for s in samples]
    with torch.no_grad():
        together = flow_loss(multires_transformer, samples, sigmas, noises)
        alone = torch.cat([flow_loss(multires_transformer, [s], sigmas[i : i + 1], [noises[i]])
                           for i, s in enumerate(samples)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def test_load_sample_rejects_latents_that_contradict_img_shapes(tmp_path, tiny_edit_model):
    make_train_store(tmp_path / "s", tiny_edit_model, [Spec((8, 8))])
    t = open_train_tables(tmp_path / "s", tiny_edit_model)
    vae = t.vae
    real = vae.img_shapes
    vae.img_shapes = lambda key: [(1, 2, 2)]  # a manifest that lies about the size
    try:
        with pytest.raises(UserError, match="do not match img_shapes"):
            from_features(t.keys[0], t.text.tensors(t.keys[0]), vae.tensors(t.keys[0]), vae.img_shapes(t.keys[0]))
    finally:
        vae.img_shapes = real


def test_a_sample_twice_in_one_step_gets_a_draw_of_its_own_each_time(tables, tiny_edit_model):
    """An optimizer step's accumulation micro-batches run on into the next epoch (6 samples in batches of 2: 3 per
    epoch; grad_accum 4), so a step can hold a sample twice. Each occurrence must get its own σ / noise / dropout:
    draws keyed by (seed, step, key) alone gave both the same, i.e. one draw counted twice in the step's mean.
    Draws of a sample's first occurrence stay what they were (every step without a repeat is unchanged)."""
    from pipeline.config import load_config
    from stages.train.data import DataStream
    from stages.train.prefetch import MicroBatches, prepare
    from stages.train.sampler import LengthAwareBatchSampler

    tc = load_config(None, {"train.device": "cpu", "train.batch_size": 2, "train.grad_accum": 4,
                            "train.sigma.sampling": "uniform", "train.caption_dropout": 0.5}).train
    cpu = torch.device("cpu")
    stream = DataStream(LengthAwareBatchSampler(tables.lengths, 2, tc.seed, world_size=1))
    batches = MicroBatches(stream, tables, tc, 0, 0, cpu, torch.float32)
    try:
        micro = [batches.next() for _ in range(tc.grad_accum)]  # optimizer step 0
    finally:
        batches.close()
    assert {m.step for m in micro} == {0} and micro[-1].epoch == 1
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    repeats = 0
    for m in micro:
        (flow,) = m.flows
        rows = m.global_batch[0]
        alone = prepare(tables, tc, rows, 0, cpu, torch.float32)  # the draws the step's first occurrences get
        for j, i in enumerate(rows):
            drawn = (flow.sigmas[j], flow.targets[j])
            if i not in seen:
                assert torch.equal(drawn[0], alone.sigmas[j]) and torch.equal(drawn[1], alone.targets[j])
                seen[i] = drawn
                continue
            repeats += 1
            assert not torch.equal(drawn[0], seen[i][0]), "the same σ for a sample's second occurrence in a step"
            assert not torch.equal(drawn[1], seen[i][1]), "the same noise for a sample's second occurrence in a step"
    assert repeats == 2  # epoch 1's first batch repeats two samples of epoch 0


def test_the_dropped_samples_of_the_train_split_are_said_once(tmp_path, tiny_edit_model, caplog):
    """`run train` / `run all` opened the train split twice (the up-to-date check, then the trainer), each open
    warned "train split: 1 of 4 samples are not in both ...", and the trainer printed its own line of the same
    drop: three lines of one fact. Now the trainer's line alone."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    make_train_store(tmp_path / "s", tiny_edit_model, mixed_specs(4), skip_vae={3})
    res = CliRunner().invoke(app, ["run", "train", "--store", str(tmp_path / "s"), "--model", tiny_edit_model,
                                   "--out", str(tmp_path / "run"), "--max-steps", "1", "--batch-size", "1",
                                   "--device", "cpu", "--set", "train.max_dropped_fraction=0.5"])
    assert res.exit_code == 0, res.output
    said = [line for line in [*res.output.splitlines(), *(r.getMessage() for r in caplog.records)]
            if "split" in line and "not in both the text and vae tables" in line]
    assert said == ["training on 3 of 4 samples of the 'train' split: 1 not in both the text and vae tables "
                    f"(encode-vae: not encoded 1; rows in {tmp_path / 's' / 'quarantine.parquet'})"], said


def test_the_dropped_report_reads_the_quarantines_keys_stages_and_reasons_only(tmp_path, monkeypatch):
    """Every rank's dropped report at each train / evaluate start reads quarantine.parquet's key, stage and reason
    columns, not its long source and detail texts (~2/3 of a 1M-row file's ~200 MB, parsed by each of 64 ranks),
    and counts the same reasons as from the whole file."""
    import pyarrow.parquet as pq

    from features.open import open_features
    from schemas import FieldSpec, Lineage, TableSchema

    fp = "0123456789abcdef"
    st = make_train_store(tmp_path / "s", "m", mixed_specs(4, 2), fingerprint=fp, skip_vae={1})
    fields = [FieldSpec("target.png", "png", kind="file"), FieldSpec("split", "string", kind="column")]
    schema = TableSchema("images", fields, Lineage("resize-bucket", config_hash="t", upstream={}, code_version="t"))
    w = st.writer("images", schema, shard_size_mb=0.0001)
    for i in range(4):
        w.add(key_of(i), files={"target.png": b"png"}, meta={"split": "train", "img_shapes": [[1, 2, 2]]})
    w.commit()
    st.add_quarantine([{"key": key_of(1), "source": "s" * 99, "stage": "encode-vae", "reason": "damaged-input",
                        "detail": "d" * 99}])
    decoded = []
    real = pq.ParquetFile.read, pq.read_table

    def read(self, columns=None, *a, **kw):
        decoded.append(columns)
        return real[0](self, columns, *a, **kw)

    def read_table(source, *a, columns=None, **kw):
        if str(source).endswith("quarantine.parquet"):
            decoded.append(columns)
        return real[1](source, *a, columns=columns, **kw)

    monkeypatch.setattr(pq.ParquetFile, "read", read)
    monkeypatch.setattr(pq, "read_table", read_table)
    rep = open_features(st.root, "m", fp, "train", 0.5).report
    assert rep["reasons"] == {"encode-vae": {"damaged-input": 1}} and rep["dropped"] == 1
    assert decoded and all(c is not None and not {"source", "detail"} & set(c) for c in decoded), decoded


def test_the_dropped_report_and_the_join_read_the_manifests_a_row_group_at_a_time(tmp_path, monkeypatch):
    """Every rank's start reads the keys and splits of `images` (the dropped report) and the split column of `text`
    and `vae` (the join) a manifest row group at a time: whole columns and their decode's scratch peaked at ~+160 MB
    private memory per rank at 1M samples (bench/train_startup.py). The report is the one the whole columns gave:
    the train and val splits' samples, the dropped ones and their reasons."""
    import pyarrow.parquet as pq

    from features.open import open_features
    from schemas import FieldSpec, Lineage, TableSchema
    from store import format as fmt

    monkeypatch.setattr(fmt, "ROW_GROUP_ROWS", 2)  # every manifest below in groups of 2 rows
    fp = "0123456789abcdef"
    st = make_train_store(tmp_path / "s", "m", mixed_specs(6, 2), fingerprint=fp, skip_vae={1})
    fields = [FieldSpec("target.png", "png", kind="file"), FieldSpec("split", "string", kind="column")]
    schema = TableSchema("images", fields, Lineage("resize-bucket", config_hash="t", upstream={}, code_version="t"))
    w = st.writer("images", schema, shard_size_mb=0.0001)
    for i in range(11):  # 8, 9: in the train split, never encoded; 10: val
        w.add(key_of(i), files={"target.png": b"png"},
              meta={"split": "val" if i in (6, 7, 10) else "train", "img_shapes": [[1, 2, 2]]})
    w.commit()
    st.add_quarantine([{"key": key_of(1), "source": "s", "stage": "encode-vae", "reason": "damaged-input"}])
    rows_read = []  # rows of each decoded table holding a split column
    real = pq.ParquetFile.read_row_group, pq.ParquetFile.read, pq.read_table

    def spied(fn):
        def read(*a, **kw):
            t = fn(*a, **kw)
            if "split" in t.column_names:
                rows_read.append(t.num_rows)
            return t
        return read

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spied(real[0]))
    monkeypatch.setattr(pq.ParquetFile, "read", spied(real[1]))
    monkeypatch.setattr(pq, "read_table", spied(real[2]))
    train = open_features(st.root, "m", fp, "train", 0.5)
    assert {k: train.report[k] for k in ("samples", "joined", "dropped", "reasons")} == {
        "samples": 8, "joined": 5, "dropped": 3,
        "reasons": {"encode-vae": {"damaged-input": 1}, "encode-text/encode-vae": {"not encoded": 2}}}
    val = open_features(st.root, "m", fp, "val", 0.5)
    assert {k: val.report[k] for k in ("samples", "joined", "dropped")} == {"samples": 3, "joined": 2, "dropped": 1}
    assert rows_read and max(rows_read) <= 2, rows_read
    train.close()
    val.close()


def test_the_dropped_report_counts_the_samples_of_both_tables_images_versions(tmp_path, monkeypatch):
    """encode-text has run on a newer `images` (2 samples added) and encode-vae not yet: the split's samples are
    those of both versions (6), 2 of them not in both. Before: counted from vae's `images` version alone - '2 of 4
    samples (50.0%)', and with more samples added, more dropped than samples ('35 of 16 samples (218.8%)')."""
    from dataclasses import replace

    import train_store
    from features.open import open_features
    from schemas import FieldSpec, Lineage, TableSchema

    fp = "0123456789abcdef"
    stock = train_store._lineage
    monkeypatch.setattr(train_store, "_lineage", lambda stage, *a: replace(
        stock(stage, *a), upstream={"images": 2 if stage == "encode-text" else 1}))
    st = make_train_store(tmp_path / "s", "m", mixed_specs(6), fingerprint=fp, skip_vae={4, 5})
    fields = [FieldSpec("target.png", "png", kind="file"), FieldSpec("split", "string", kind="column")]
    for n in (4, 6):  # images v1: samples 0-3, v2: 0-5
        schema = TableSchema("images", fields, Lineage("resize-bucket", config_hash=f"t{n}", upstream={},
                                                       code_version="t"))
        w = st.writer("images", schema)
        for i in range(n):
            w.add(key_of(i), files={"target.png": b"png"}, meta={"split": "train", "img_shapes": [[1, 2, 2]]})
        w.commit()
    rep = open_features(st.root, "m", fp, "train", 0.5).report
    assert (rep["samples"], rep["joined"], rep["dropped"]) == (6, 4, 2)
    assert rep["dropped_fraction"] == pytest.approx(1 / 3)


def test_an_empty_val_split_names_resize_val_fraction_when_it_is_zero(tiny_edit_model, tmp_path):
    """Features encoded from images split with resize.val_fraction: 0: the empty 'val' split names that setting
    (before: 'add training samples', sending the user after samples they have)."""
    from models.loading import model_files
    from schemas.config import EvaluateConfig
    from schemas.lineage import Lineage
    from schemas.table import FieldSpec, TableSchema
    from features.open import open_configured

    st = make_train_store(tmp_path / "store", tiny_edit_model, mixed_specs(3, 0))
    images = TableSchema(name="images", fields=[FieldSpec("split", "string", kind="column")],
                         lineage=Lineage(stage="resize-bucket", config_hash="test"),
                         attrs={"resize": {"val_fraction": 0.0}})
    w = st.writer("images", images)
    w.add("0" * 32, meta={"split": "train", "img_shapes": [[1, 4, 4]]})
    w.commit()
    with pytest.raises(UserError) as e:
        open_configured(EvaluateConfig(), "evaluate", tmp_path / "store", tiny_edit_model,
                        model_files(tiny_edit_model), "val")
    assert "'val' split is empty" in str(e.value) and "resize.val_fraction: 0" in str(e.value)
