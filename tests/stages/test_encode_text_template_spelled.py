"""encode-text: the model's own prompt template spelled out in the config is the default, not a change. Before, a
config naming `prompt_template_start_idx: 64` (or the template too) hashed otherwise: a new `text` version, every
sample through the VL encoder again, for features equal bit for bit."""

from __future__ import annotations

from pipeline.config import load_config
from stages.encode import text as encode_text
from store import Store


def _spelled(fmt, template: bool) -> dict:
    return {"encode_text.prompt_template_start_idx": fmt.start_idx,
            **({"encode_text.prompt_template": fmt.template} if template else {})}


def test_the_default_template_spelled_out_reuses_the_table(tiny_edit_model, edit_store, monkeypatch):
    fmt = encode_text.prompt_format("edit", None, None)
    first = encode_text.run(load_config(None), edit_store, tiny_edit_model)
    for template in (False, True):
        again = encode_text.run(load_config(None, _spelled(fmt, template)), edit_store, tiny_edit_model)
        assert again.up_to_date and again.version == first.version and again.encoded == 0, template
    other = load_config(None, {"encode_text.prompt_template_start_idx": fmt.start_idx - 1})
    assert encode_text.run(other, edit_store, tiny_edit_model).version == first.version + 1  # a real change

    # a table hashed with the spelling written out (before this rule) stays current under either spelling
    with monkeypatch.context() as m:
        m.setattr(encode_text, "template_spellings", lambda section, fmt: (section, ()))
        before = encode_text.run(load_config(None, _spelled(fmt, True)), edit_store, tiny_edit_model)
    assert before.version == first.version + 2 and before.encoded == len(Store(edit_store).reader("images"))
    for spelled in (_spelled(fmt, True), {}):
        now = encode_text.run(load_config(None, spelled), edit_store, tiny_edit_model)
        assert now.up_to_date and now.version in (first.version, before.version) and now.encoded == 0
