"""The encoders' summaries list their quarantined samples by reason, as resize-bucket's does
(`schemas.stage.quarantined_line`): before they said only "quarantined N", the reasons left to quarantine.parquet."""

from __future__ import annotations

from pipeline.config import load_config
from stages.encode import text as encode_text, vae as encode_vae
from stages.encode.summary import Summary, over_ranks

F32 = {"encode_text.dtype": "float32", "encode_vae.dtype": "float32"}
TWO = "edit model needs exactly one control image"


def test_encode_text_and_vae_list_their_quarantined_samples_by_reason(tiny_edit_model, tmp_path, images_fixture):
    Sample = images_fixture.Sample
    store = tmp_path / "store"
    images_fixture.write(store, [Sample("make it <|image_pad|> red", (64, 64), [(64, 64)], [(64, 64)]),
                                 Sample("two controls", (64, 64), [(64, 64)] * 2, [(64, 64)] * 2),
                                 Sample("make it red", (64, 64), [(64, 64)], [(64, 64)])])
    cfg = load_config(None, F32)
    text = encode_text.run(cfg, store, tiny_edit_model)
    vae = encode_vae.run(cfg, store, tiny_edit_model, batch_size=1)
    rows = f" (rows in {store / 'quarantine.parquet'})"
    assert str(text).splitlines()[1] == f"quarantined 2: {TWO} 1, prompt does not fit the template 1{rows}"
    assert str(vae).splitlines()[1] == f"quarantined 1: {TWO} 1{rows}"
    assert text.to_json()["quarantined_by_reason"] == {TWO: 1, "prompt does not fit the template": 1}


def test_the_reasons_are_summed_over_the_ranks(monkeypatch):
    import models.collective

    ranks = [Summary("encode-vae", "vae", version=1, encoded=3, quarantined=q, quarantined_by_reason=by, rank=r,
                     world_size=2) for r, (q, by) in enumerate([(2, {TWO: 2}), (3, {TWO: 1, "damaged-input": 2})])]
    sent = []
    monkeypatch.setattr(models.collective, "all_sum", lambda world, values: sent.append(values) or values)
    monkeypatch.setattr(models.collective, "all_max", lambda world, values: values)
    for s in ranks:
        over_ranks(s, 2)
    total = [sum(column) for column in zip(*sent)]
    monkeypatch.setattr(models.collective, "all_sum", lambda world, values: total)
    summed = over_ranks(ranks[1], 2)
    assert summed.quarantined == 5 and summed.quarantined_by_reason == {TWO: 3, "damaged-input": 2}
    assert str(summed).splitlines()[1] == f"quarantined 5: damaged-input 2, {TWO} 3"
