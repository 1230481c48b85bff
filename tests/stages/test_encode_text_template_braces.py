"""encode_text.prompt_template is read by `str.format`: a template whose only field is not a bare '{}' (a '{style}',
a '{0}', a lone '}') is refused in one line before the model loads. Before, the first sample's preparation raised
the KeyError / ValueError with a traceback, after the VL model had loaded."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from schemas.errors import UserError
from stages.encode import text as encode_text


def _default(variant: str = "edit-plus") -> str:
    return encode_text.prompt_format(variant, None, None).template


@pytest.mark.parametrize("edit, found", [("Describe {style} and", "{style}, {}"), ("Describe {0} and", "{0}, {}"),
                                         ("Describe } and", "Single '}'"), ("Describe {:>5} and", "{:>5}, {}")])
def test_a_template_with_another_field_is_refused_in_one_line(edit, found):
    with pytest.raises(UserError, match="encode_text.prompt_template must hold exactly one") as refused:
        encode_text.prompt_format("edit-plus", _default().replace("Describe", edit), 64)
    assert found in str(refused.value) and "\n" not in str(refused.value)


def test_doubled_braces_are_text():
    fmt = encode_text.prompt_format("edit", _default("edit").replace("Describe", "Describe {{json}}, {{}} and"), 64)
    assert "Describe {json}, {} and" in fmt.text("turn it blue", 1) and "turn it blue" in fmt.text("turn it blue", 1)


def test_the_cli_says_it_before_the_model_loads(tiny_plus_model, plus_store, tmp_path, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("models.loading.load_component", no_load)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"encode_text": {"prompt_template": _default().replace("Describe", "Describe {style}"),
                                                      "prompt_template_start_idx": 64}}))
    res = CliRunner().invoke(app, ["run", "encode-text", "--store", str(plus_store), "--model", tiny_plus_model,
                                   "--device", "cpu", "--config", str(config)])
    assert res.exit_code == 1 and "Traceback" not in res.output and "the model was loaded" not in res.output
    assert [ln for ln in res.output.splitlines() if "error:" in ln][0].count("prompt_template must hold exactly one")


def test_a_start_idx_past_the_templates_own_tokens_is_refused_before_the_encoder_loads(tiny_edit_model, edit_store,
                                                                                        monkeypatch):
    """Before: `prompt_template_start_idx: 200` stored every sample's prompt_embeds as [0, D], nothing said."""
    from models import loading
    from pipeline.config import load_config
    from store import Store

    load = loading.load_component
    monkeypatch.setattr(loading, "load_component", lambda model, name, *a, **k: (
        pytest.fail("the text encoder was loaded") if name == "text_encoder" else load(model, name, *a, **k)))
    with pytest.raises(UserError, match="prompt_template_start_idx is 65, past the 64 tokens of the template"):
        encode_text.run(load_config(None, {"encode_text.prompt_template_start_idx": 65}), edit_store, tiny_edit_model)
    assert "text" not in Store(edit_store).tables()


def test_a_doubled_brace_before_the_instruction_counts_as_one_character_of_the_templates_own_tokens():
    """The template's own tokens are those of its text before the instruction as formatted: a '{{}}' in its system
    part is text. Before, its '{}' was taken for the instruction's slot, the prefix counted short, and a valid
    start_idx refused (a character tokenizer here: one token per character)."""
    template = _default("edit").replace("Describe", "Describe {{}} and")
    chars = 358  # the system prompt and the user turn's markers before the picture, '{{}}' written as '{}'
    assert template.index("<|vision_start|>") - template.count("{{") - template.count("}}") == chars
    by_char = lambda text: {"input_ids": list(text)}  # noqa: E731
    assert template.index("{{}}") < chars - 4
    encode_text.check_start_idx(encode_text.prompt_format("edit", template, chars), by_char)  # its own: no refusal
    with pytest.raises(UserError, match=f"past the {chars} tokens"):
        encode_text.check_start_idx(encode_text.prompt_format("edit", template, chars + 1), by_char)
