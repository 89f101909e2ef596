"""`fitlm generate` prints nothing on stdout until the model, its tokenizer and the prompt are loaded and checked:
an error is the whole output (it used to follow the echoed prompt: "hifitlm generate: error: ...")."""

from __future__ import annotations

import pytest

from fitlm.cli import main
from tests.unit.serve_models import chat_model_dir


@pytest.mark.parametrize("where", ["missing", "not-a-model"])
def test_a_bad_model_is_only_an_error(tmp_path, capsys, where):
    (tmp_path / "not-a-model").mkdir()
    assert main(["generate", str(tmp_path / where), "--prompt", "hi"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "fitlm generate: error: " in err and where in err


def test_a_prompt_the_model_cannot_take_is_only_an_error_and_a_good_one_is_echoed(tmp_path, capsys):
    model = chat_model_dir(tmp_path, context=8)
    assert main(["generate", str(model), "--prompt", "hi " * 40]) == 2  # more tokens than max_seq_len
    out, err = capsys.readouterr()
    assert out == "" and "shorten the prompt" in err
    assert main(["generate", str(model), "--prompt", "hi", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith("hi")
