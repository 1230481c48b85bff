"""`evaluate --all-checkpoints` reruns: the base images (LoRA off) are reused from REPORT/base-images/ when every
input of them is unchanged, regenerated when any is (stages/evaluate/base_images.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from test_evaluate_checkpoints import CFG, _ckpts, run_and_store  # noqa: F401  (the module's fixture)

from schemas.config import EvaluateConfig
from stages.evaluate import base_images
from stages.evaluate import checkpoints as ev


def _runner(monkeypatch):
    """ev.run with the number of images generated and the report's rows of each run."""
    import models.generate
    from stages.evaluate import checkpoint_report

    calls, rows = [], []
    generate, write = models.generate.generate, checkpoint_report.write_checkpoint_report
    monkeypatch.setattr(models.generate, "generate", lambda *a, **k: (calls.append(1), generate(*a, **k))[1])
    monkeypatch.setattr(checkpoint_report, "write_checkpoint_report",
                        lambda out, metrics, r: (rows.append(r), write(out, metrics, r))[1])

    def run(cfg, root, model, out) -> tuple[int, list]:
        calls.clear()
        ev.run(cfg, root / "store", model, _ckpts(root), out)
        return len(calls), rows[-1]

    return run


def test_a_rerun_reuses_the_base_images_and_a_changed_input_regenerates_them(run_and_store, tiny_edit_model,
                                                                              tmp_path, monkeypatch):
    """Before: every rerun generated the base column again (2 samples x 3 columns = 6 images, 6 again), then the
    best and last again (4). Now a rerun generates none, its kept files byte-identical, with the same pixels;
    another seed regenerates every column, a damaged kept PNG that one image. The last checkpoint (step 30) holds
    the best's (step 20) bytes: its images are the best's, kept under those bytes, not generated twice."""
    root, out = run_and_store, tmp_path / "report"
    run = _runner(monkeypatch)
    cfg = EvaluateConfig(**{**CFG, "num_samples": 2, "num_inference_steps": 2})
    n, first = run(cfg, root, tiny_edit_model, out)
    assert n == 4 and list(first[0].outputs) == ["base", "best (step 20)", "last (step 30)"]
    kept = {p: p.read_bytes() for f in (base_images.FOLDER, base_images.LORA_FOLDER, base_images.LAST_FOLDER)
            for p in sorted((out / f).iterdir())}
    assert len(kept) == 3 * 3  # each column: 2 PNGs (unless two are identical) and its index
    n, again = run(cfg, root, tiny_edit_model, out)
    assert n == 0
    assert {p: p.read_bytes() for p in kept} == kept and all(p.exists() for p in kept)
    for a, b in zip(first, again):
        assert list(a.outputs) == list(b.outputs)
        for label in a.outputs:
            np.testing.assert_array_equal(np.asarray(a.outputs[label]), np.asarray(b.outputs[label]))
        assert a.scores == b.scores

    n, other_seed = run(cfg.model_copy(update={"seed": cfg.seed + 1}), root, tiny_edit_model, out)
    assert n == 4
    for label in first[0].outputs:  # every column pictured again, at that seed
        assert not np.array_equal(np.asarray(other_seed[0].outputs[label]), np.asarray(first[0].outputs[label]))

    png = _files(out)[0]
    data = bytearray(png.read_bytes())
    data[-20] ^= 0xFF
    png.write_bytes(bytes(data))
    n, again = run(cfg.model_copy(update={"seed": cfg.seed + 1}), root, tiny_edit_model, out)
    assert n == 1  # the damaged one regenerated, not shown (the others reused: each is checked alone)
    for a, b in zip(other_seed, again):
        for label in a.outputs:
            np.testing.assert_array_equal(np.asarray(a.outputs[label]), np.asarray(b.outputs[label]))


def _files(out: Path) -> list[Path]:
    """The kept base images' files, in the order of the index's items (named by their sha256 now)."""
    import json

    index = json.loads((out / base_images.FOLDER / base_images.INDEX).read_text())
    return [out / base_images.FOLDER / name for name, _ in index["items"].values()]


def test_a_killed_run_leaving_only_base_images_does_not_block_the_report_folder(run_and_store, tiny_edit_model,
                                                                                tmp_path, monkeypatch):
    """The base images are written before the best / last ones: a run killed then leaves base-images/ without a
    metrics.json, and the rerun takes the folder as its own (not "not empty and holds no earlier report")."""
    root, out = run_and_store, tmp_path / "report"
    run = _runner(monkeypatch)
    cfg = EvaluateConfig(**{**CFG, "num_samples": 1, "num_inference_steps": 2})
    run(cfg, root, tiny_edit_model, out)
    for f in ("metrics.json", "index.html", "grid.png"):
        (out / f).unlink()
    n, _ = run(cfg, root, tiny_edit_model, out)
    assert n == 0 and (out / "metrics.json").is_file()  # every column kept (best and last too)


def test_every_input_of_the_base_images_is_in_their_key(tmp_path, monkeypatch):
    """Each input changed alone gives another key (its group, `group_key`, or its items, `item_ids`: so other
    images); the same inputs, the same key. The group holds none of the inputs an image's item holds: which samples
    are pictured and the extra prompts' own."""
    import diffusers

    from schemas.config import ExtraPrompt

    img = tmp_path / "ref.png"
    img.write_bytes(b"one picture")
    cfg = EvaluateConfig(device="cpu", dtype="float32", extra_prompts=[ExtraPrompt(prompt="p", images=[str(img)])])
    features = {"store": "/s", "tables": {"text": "t1", "vae": "v1"}, "model_fingerprint": "m1"}
    samples = ["k1", "k2"]

    def key(c, f, s):
        return base_images.group_key(c, f), tuple(base_images.item_ids(c, s))

    first = key(cfg, features, samples)
    assert key(cfg, dict(features), list(samples)) == first

    changed = {
        "store": (cfg, {**features, "store": "/other"}, samples),
        "text table": (cfg, {**features, "tables": {"text": "t2", "vae": "v1"}}, samples),
        "vae table": (cfg, {**features, "tables": {"text": "t1", "vae": "v2"}}, samples),
        "model files": (cfg, {**features, "model_fingerprint": "m2"}, samples),
        "picked samples": (cfg, features, ["k1", "k3"]),
    }
    for name, value in [("seed", 7), ("num_inference_steps", 3), ("true_cfg_scale", 2.5), ("negative_prompt", "x"),
                        ("dtype", "bfloat16"), ("device", "meta"), ("attention_backend", "flash"),
                        ("quantize_base", "int8"),
                        ("extra_prompts", [ExtraPrompt(prompt="q", images=[str(img)])]),
                        ("extra_prompts", [ExtraPrompt(prompt="p", images=[str(img)], height=64, width=64)])]:
        changed[f"{name}={value}"] = (cfg.model_copy(update={name: value}), features, samples)
    keys = {name: key(*args) for name, args in changed.items()}
    img.write_bytes(b"another picture")  # same path, other bytes
    keys["extra image bytes"] = key(cfg, features, samples)
    img.write_bytes(b"one picture")
    monkeypatch.setattr(diffusers, "__version__", "0.0.0")
    keys["diffusers version"] = key(cfg, features, samples)
    monkeypatch.undo()
    assert first not in keys.values() and len(set(keys.values())) == len(keys), keys

    # the group: the same but for which samples are pictured (num_samples only picks them) and the extra prompts'
    # own, each in its own item: another of those regenerates no other image
    own = ("picked samples", "negative_prompt=x", "extra image bytes", *(n for n in changed if n.startswith("extra")))
    for name in own:
        assert keys[name][0] == first[0], name
    assert base_images.group_key(cfg.model_copy(update={"num_samples": 9}), features) == first[0]
    # no true CFG: the negative prompt is not read, nor in the item
    no_cfg = cfg.model_copy(update={"true_cfg_scale": 1.0})
    assert base_images.extra_id(no_cfg.model_copy(update={"negative_prompt": "x"}), cfg.extra_prompts[0]) == \
        base_images.extra_id(no_cfg, cfg.extra_prompts[0])


def test_the_key_takes_the_source_of_every_module_generation_runs_through(tmp_path, monkeypatch):
    """This project's code changed by an upgrade regenerates the base images. Before, the key took a hand-kept list
    of 11 modules, which missed models/multires.py (the Edit transformer's multi-resolution forward, the latents'
    packing), models/attention.py (the attention backend), models/quantize.py, models/sample.py (the stored
    features' decoding) and schemas/img_shapes.py (the patch size): a change to any of them reused images the new
    code would not make. Each file below, changed alone (in a copy of the packages), gives another key."""
    import shutil

    project, root = Path(base_images.__file__).resolve().parents[2], tmp_path / "src"
    for package in ("models", "features", "schemas", "stages/evaluate"):
        shutil.copytree(project / package, root / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(base_images, "SOURCE_ROOT", root, raising=False)  # (before: no such setting, real files)
    cfg = EvaluateConfig(device="cpu", dtype="float32")
    features = {"store": "/s", "tables": {"text": "t1", "vae": "v1"}, "model_fingerprint": "m1"}
    before = base_images.group_key(cfg, features)
    for module in ("models/multires.py", "models/attention.py", "models/quantize.py", "models/sample.py",
                   "schemas/img_shapes.py", "models/generate.py", "stages/evaluate/qwen21.py"):
        source = root / module
        original = source.read_text()
        source.write_text(original + "\n# an upgrade's change\n")
        assert base_images.group_key(cfg, features) != before, module
        source.write_text(original)
    assert base_images.group_key(cfg, features) == before


def test_single_lora_evaluate_reuses_its_base_images_through_the_same_cache(run_and_store, tiny_edit_model, tmp_path,
                                                                            monkeypatch):
    """One-LoRA evaluate rerun (not up to date: another LoRA, another scale) generated its base column again:
    2 samples -> 4 images every run. Now the base images are kept in OUT/base-images/ by the --all-checkpoints
    mechanism (`base_images`, keyed by every input of them): a retrained LoRA or another LoRA scale generates only
    the LoRA column (2), with the same base pixels; another seed regenerates both (4)."""
    import models.generate
    from stages.evaluate import report as report_mod
    from stages.evaluate import stage

    calls, rows = [], []
    generate, write = models.generate.generate, report_mod.write_report
    monkeypatch.setattr(models.generate, "generate", lambda *a, **k: (calls.append(1), generate(*a, **k))[1])
    monkeypatch.setattr(stage, "write_report", lambda out, metrics, r: (rows.append(r), write(out, metrics, r))[1])
    root, out = run_and_store, tmp_path / "report"
    ckpts = dict(_ckpts(root))

    def run(cfg, lora) -> int:
        calls.clear()
        stage.run(cfg, root / "store", tiny_edit_model, lora, out)
        return len(calls)

    cfg = EvaluateConfig(**{**CFG, "num_samples": 2, "num_inference_steps": 2})
    assert run(cfg, ckpts[20]) == 4  # a zero LoRA (the base itself)
    first = rows[-1]
    assert run(cfg, ckpts[10]) == 2  # another LoRA (far from the base): the base images are reused
    assert run(cfg.model_copy(update={"lora_scale": 0.5}), ckpts[10]) == 2  # another scale: reused
    for a, b in zip(first, rows[-1]):
        np.testing.assert_array_equal(np.asarray(a.base), np.asarray(b.base))
    assert not np.array_equal(np.asarray(first[0].lora), np.asarray(rows[-1][0].lora))  # the LoRA column is new
    assert run(cfg.model_copy(update={"seed": cfg.seed + 1}), ckpts[10]) == 4  # an input of the base: regenerated
    assert not np.array_equal(np.asarray(rows[-1][0].base), np.asarray(first[0].base))
    # the other seed's images alone: the earlier group's files are removed
    folder = out / base_images.FOLDER
    assert sorted(folder.iterdir()) == sorted([*_files(out), folder / base_images.INDEX])
    assert len(_files(out)) == 2


def test_another_loss_grid_generates_no_image_of_a_single_lora_report(run_and_store, tiny_edit_model, tmp_path,
                                                                       monkeypatch):
    """The seeds / σ of the held-out loss are no input of the pictures: a single-LoRA report rerun for another grid
    generates no image (it generated both columns again, 4 images), and its pictures and their scores are a fresh
    report's of that grid; the LoRA images are kept under the LoRA's bytes (another LoRA: its column alone)."""
    import models.generate
    from stages.evaluate import report as report_mod
    from stages.evaluate import stage

    calls, rows = [], []
    generate, write = models.generate.generate, report_mod.write_report
    monkeypatch.setattr(models.generate, "generate", lambda *a, **k: (calls.append(1), generate(*a, **k))[1])
    monkeypatch.setattr(stage, "write_report", lambda out, metrics, r: (rows.append(r), write(out, metrics, r))[1])
    root, ckpts = run_and_store, dict(_ckpts(run_and_store))

    def run(cfg, lora, out) -> tuple[int, dict]:
        calls.clear()
        res = stage.run(cfg, root / "store", tiny_edit_model, lora, out, skip_if_done=True)
        return len(calls), res.metrics

    cfg = EvaluateConfig(**{**CFG, "num_samples": 2, "num_inference_steps": 2})
    grid = cfg.model_copy(update={"noise_seeds": [0, 2], "timesteps": [0.5]})
    assert run(cfg, ckpts[10], tmp_path / "report")[0] == 4
    made, metrics = run(grid, ckpts[10], tmp_path / "report")
    assert made == 0 and "noise seeds [0, 2]" in metrics["loss"]["protocol"]  # the losses of the new grid
    kept = rows[-1]
    made, fresh = run(grid, ckpts[10], tmp_path / "fresh")
    assert made == 4 and metrics["generation"] == fresh["generation"]
    for a, b in zip(kept, rows[-1]):
        np.testing.assert_array_equal(np.asarray(a.base), np.asarray(b.base))
        np.testing.assert_array_equal(np.asarray(a.lora), np.asarray(b.lora))
    assert run(grid, ckpts[20], tmp_path / "report")[0] == 2  # another LoRA: its own column


def test_another_lora_scale_generates_the_lora_column_alone(run_and_store, tiny_edit_model, tmp_path, monkeypatch):
    """evaluate.lora_scale is in the key of the LoRA images (OUT/lora-images), not of the base images: a report
    rerun at another scale generates its LoRA column again (the base column kept), and pictures the LoRA at that
    scale; a rerun at that scale generates nothing."""
    import models.generate
    from stages.evaluate import report as report_mod
    from stages.evaluate import stage

    calls, rows = [], []
    generate, write = models.generate.generate, report_mod.write_report
    monkeypatch.setattr(models.generate, "generate", lambda *a, **k: (calls.append(1), generate(*a, **k))[1])
    monkeypatch.setattr(stage, "write_report", lambda out, metrics, r: (rows.append(r), write(out, metrics, r))[1])
    lora, out = dict(_ckpts(run_and_store))[10], tmp_path / "report"

    def made(cfg) -> int:
        calls.clear()
        stage.run(cfg, run_and_store / "store", tiny_edit_model, lora, out, skip_if_done=True)
        return len(calls)

    cfg = EvaluateConfig(**{**CFG, "num_samples": 2, "num_inference_steps": 2})
    half = cfg.model_copy(update={"lora_scale": 0.5})
    assert made(cfg) == 4
    full_scale = rows[-1]
    assert made(half) == 2  # the LoRA column alone
    for a, b in zip(full_scale, rows[-1]):
        np.testing.assert_array_equal(np.asarray(a.base), np.asarray(b.base))
        assert not np.array_equal(np.asarray(a.lora), np.asarray(b.lora))  # the LoRA at half strength
    assert made(half) == 0


def test_single_lora_evaluate_reuses_its_base_losses(run_and_store, tiny_edit_model, tmp_path, monkeypatch):
    """The base's held-out loss pass (LoRA off) cost as much as the LoRA's and was run again by every rerun.
    Now it is kept in OUT/base-losses.safetensors under the base images' key over all val samples: another LoRA
    runs one loss pass (the base numbers equal to the bit); another noise seed, or a damaged file, runs both."""
    from stages.evaluate import base_losses, loss_section, stage

    passes = []
    grid = loss_section.loss_grid
    monkeypatch.setattr(loss_section, "loss_grid", lambda *a, **k: (passes.append(k.get("desc")), grid(*a, **k))[1])
    root, out = run_and_store, tmp_path / "report"
    ckpts = dict(_ckpts(root))
    cfg = EvaluateConfig(**CFG)

    def run(cfg, lora) -> tuple[dict, list]:
        passes.clear()
        return stage.run(cfg, root / "store", tiny_edit_model, lora, out).metrics["loss"], list(passes)

    first, n = run(cfg, ckpts[20])
    assert len(n) == 2
    again, n = run(cfg, ckpts[10])
    assert n == ["held-out loss (lora)"]  # the base pass reused
    assert again["overall"]["base"] == first["overall"]["base"]
    assert again["per_sample"].keys() == first["per_sample"].keys()
    assert again["overall"]["lora"] != first["overall"]["lora"]  # a far LoRA: its own numbers
    # settings of the pictures alone (before, inputs of the base losses' key too: the pass ran again)
    _, n = run(cfg.model_copy(update={"seed": cfg.seed + 1, "num_inference_steps": 3, "num_samples": 1}), ckpts[10])
    assert n == []  # both grids kept (OUT/lora-losses): no loss pass (the LoRA's ran again before they were)
    _, n = run(cfg.model_copy(update={"noise_seeds": [0, 2]}), ckpts[10])
    assert len(n) == 2  # an input of the base losses: recomputed (seed 2's cells: test_evaluate_lora_grown_grid)
    # the file alone, as a report made before the grids were kept: a damaged one recomputed
    import shutil

    from stages.evaluate.lora_losses import FOLDER

    shutil.rmtree(out / FOLDER)
    (out / base_losses.FILE).write_bytes((out / base_losses.FILE).read_bytes()[:-8])  # truncated
    _, n = run(cfg.model_copy(update={"noise_seeds": [0, 2]}), ckpts[10])
    assert len(n) == 2
    shutil.rmtree(out / FOLDER)
    _, n = run(cfg.model_copy(update={"noise_seeds": [0, 2]}), ckpts[10])
    assert len(n) == 1


def test_a_flipped_bit_in_the_kept_base_losses_is_recomputed_not_reused(tmp_path):
    """The base losses file holds numbers only: a bit flipped in them (disk, copy) still parses as safetensors
    with the right key, shape and dtype, and was reused as the base's held-out loss. Now the numbers' sha256 is
    recorded beside the key (as each base image's is), and a file whose numbers differ from it is recomputed."""
    from stages.evaluate import base_losses

    grid = np.arange(24, dtype=np.float64).reshape(2, 3, 4) / 7
    assert base_losses.cached(tmp_path, "k", grid.shape, lambda: grid) is not None
    path = tmp_path / base_losses.FILE
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # inside the last number
    path.write_bytes(bytes(data))
    recomputed = []
    got = base_losses.cached(tmp_path, "k", grid.shape, lambda: (recomputed.append(1), grid)[1])
    assert recomputed == [1]
    np.testing.assert_array_equal(got, grid)
    assert base_losses.cached(tmp_path, "k", grid.shape, lambda: 1 / 0) is not None  # rewritten intact: reused


def test_the_base_losses_are_kept_under_the_vae_version_they_were_read_from(run_and_store, tiny_edit_model,
                                                                           tmp_path, monkeypatch):
    """The key named the store's current text / vae versions at the time it was computed (after the loss pass
    began), not the versions read: a new vae version made current meanwhile (an encode beside evaluate) got the
    old version's base losses recorded under its name, and the next run, reading the new version, reused them.
    Now the key takes the versions the val samples were read from."""
    import shutil

    from stages.evaluate import loss_section, stage
    from store import Store

    store, out = tmp_path / "store", tmp_path / "report"
    shutil.copytree(run_and_store / "store", store)
    ckpts = dict(_ckpts(run_and_store))
    passes = []
    grid, read = loss_section.loss_grid, stage.read_val_samples
    monkeypatch.setattr(loss_section, "loss_grid", lambda *a, **k: (passes.append(k.get("desc")), grid(*a, **k))[1])

    def read_then_new_version(*a, **k):  # v1 read; then a v2 (a copy: its own identity) becomes current
        result = read(*a, **k)
        st = Store(store)
        v = st.tables()["vae"]
        shutil.copytree(st.version_dir("vae", v), st.version_dir("vae", v + 1))
        st.set_current("vae", v + 1)
        return result

    monkeypatch.setattr(stage, "read_val_samples", read_then_new_version)
    stage.run(EvaluateConfig(**CFG), store, tiny_edit_model, ckpts[10], out)
    monkeypatch.setattr(stage, "read_val_samples", read)
    passes.clear()
    stage.run(EvaluateConfig(**CFG), store, tiny_edit_model, ckpts[20], out)
    assert len(passes) == 2  # v2 read: its base pass computed, not v1's numbers reused


def test_the_loss_array_of_all_checkpoints_is_keyed_by_the_versions_read(run_and_store, tiny_edit_model, tmp_path,
                                                                         monkeypatch):
    """`--all-checkpoints` keyed its loss array by the store's current text / vae versions looked up before the
    val split was opened: a vae version made current in between (an encode beside evaluate) got its losses
    recorded under the old version's key, and a later run reading the old version reused them. Now the key (and
    the report's settings) name the versions read."""
    import json
    import shutil

    from stages.evaluate import val_samples
    from store import Store

    store, out = tmp_path / "store", tmp_path / "report"
    shutil.copytree(run_and_store / "store", store)
    st = Store(store)
    old = st.tables()["vae"]
    read = val_samples.read_val_samples

    def new_version_then_read(*a, **k):  # keyed at v1; a v2 (a copy: its own identity) current before the read
        shutil.copytree(st.version_dir("vae", old), st.version_dir("vae", old + 1))
        st.set_current("vae", old + 1)
        return read(*a, **k)

    monkeypatch.setattr(val_samples, "read_val_samples", new_version_then_read)
    ev.run(EvaluateConfig(**CFG), store, tiny_edit_model, _ckpts(run_and_store)[:1], out)
    metrics = json.loads((out / "metrics.json").read_text())
    read_id = st.version_id("vae", old + 1)
    assert metrics["run"]["settings"]["tables"]["vae"] == read_id == metrics["run"]["tables"]["vae"]

    monkeypatch.setattr(val_samples, "read_val_samples", read)
    st.set_current("vae", old)  # v1 again: its losses were never computed, none may be reused
    again = ev.run(EvaluateConfig(**CFG), store, tiny_edit_model, _ckpts(run_and_store)[:1], out)
    assert again.evaluated == 1


def _counting_base(monkeypatch):
    """count(f): f's result and the number of base images it generated (checkpoint_report.column, "base")."""
    from stages.evaluate import checkpoint_report

    made, column = [], checkpoint_report.column
    monkeypatch.setattr(checkpoint_report, "column", lambda jobs, *a: (made.append(len(jobs)) if a[-1] == "base"
                                                                       else None, column(jobs, *a))[1])

    def count(f, *args, **kwargs):
        made.clear()
        return f(*args, **kwargs), sum(made)

    return count


def test_more_pictured_samples_generate_only_the_base_images_not_kept(run_and_store, tiny_edit_model, tmp_path,
                                                                      monkeypatch):
    """The base images were kept under one key over the set of samples pictured: num_samples 1 -> 2 generated both
    base images again (1, then 2; each a full denoising run, twice with true CFG). Now each is kept under its own
    inputs: 1, then the one not kept yet, the first sample's pixels reused; fewer again: none. The report of the
    other num_samples is not up to date (`skip_if_done`: its rows are other ones) but reuses them (single LoRA and
    --all-checkpoints alike)."""
    from stages.evaluate import stage

    root = run_and_store
    count = _counting_base(monkeypatch)
    cfg = EvaluateConfig(**{**CFG, "num_samples": 1, "num_inference_steps": 2})
    lora = dict(_ckpts(root))[10]

    def one(n: int):
        return count(stage.run, cfg.model_copy(update={"num_samples": n}), root / "store", tiny_edit_model, lora,
                     tmp_path / "one", skip_if_done=True)

    (first, n1), (second, n2) = one(1), one(2)
    assert (n1, n2) == (1, 1) and not second.up_to_date
    assert len(second.metrics["generation"]["samples"]) == 2
    assert second.metrics["generation"]["samples"][0] == first.metrics["generation"]["samples"][0]  # same pixels
    fewer, n = one(1)
    assert not fewer.up_to_date and n == 0
    assert fewer.metrics["generation"]["samples"] == first.metrics["generation"]["samples"]
    assert one(1)[0].up_to_date

    made = [count(ev.run, cfg.model_copy(update={"num_samples": n}), root / "store", tiny_edit_model, _ckpts(root),
                  tmp_path / "all", skip_if_done=True)[1] for n in (1, 2, 1)]
    assert made == [1, 1, 0]


def _extra_prompt(tmp_path: Path, i: int) -> dict:
    """An extra prompt with its own control picture (the tiny model's size)."""
    from PIL import Image

    ref = tmp_path / f"ref{i}.png"
    Image.fromarray(np.random.default_rng(i).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(ref)
    return {"prompt": f"make it colour {i}", "images": [str(ref)], "height": 32, "width": 32}


def test_another_extra_prompt_generates_only_its_own_base_image(run_and_store, tiny_edit_model, tmp_path,
                                                                monkeypatch):
    """The group key held every extra prompt (and its images' bytes) and the negative prompt (read with extra
    prompts): a second extra prompt added regenerated every base image, 1 val sample + 2 extra prompts = 3 (each a
    full denoising run with true CFG). Now a val sample's image is kept under inputs without the extra prompts
    (its negative is its stored empty prompt) and each extra prompt's under its own: 1 generated, the others'
    pixels reused; a changed negative prompt regenerates the extra prompts' images alone."""
    import models.edit
    from stages.evaluate import stage

    # the controls' VAE view at 256² rather than the stock ~1024² (as tests/stages/test_predict.py): each extra
    # prompt's text and VAE encoding took ~8 s of CPU, and which images are generated does not depend on its size
    monkeypatch.setattr(models.edit, "VAE_AREA", 256 * 256)
    root = run_and_store
    count = _counting_base(monkeypatch)
    lora = dict(_ckpts(root))[10]
    cfg = EvaluateConfig(**{**CFG, "num_samples": 1, "num_inference_steps": 2, "dtype": "float32",
                            "true_cfg_scale": 2.0, "extra_prompts": [_extra_prompt(tmp_path, 1)]})

    def run(c):
        result, made = count(stage.run, c, root / "store", tiny_edit_model, lora, tmp_path / "one")
        return result.metrics["generation"]["samples"], made

    first, n = run(cfg)
    assert n == 2
    two = cfg.model_copy(update={"extra_prompts": [*cfg.extra_prompts,
                                                   EvaluateConfig(extra_prompts=[_extra_prompt(tmp_path, 2)])
                                                   .extra_prompts[0]]})
    second, n = run(two)
    assert n == 1
    assert second[:2] == first  # the val sample's and the first extra prompt's rows: the kept pixels
    moved = two.model_copy(update={"extra_prompts": two.extra_prompts[::-1]})
    assert run(moved)[1] == 0  # its place is no input of an extra prompt's image
    assert run(two.model_copy(update={"negative_prompt": "blurry"}))[1] == 2  # the extra prompts' own
    assert run(two.model_copy(update={"negative_prompt": "blurry", "extra_prompts": []}))[1] == 0
