"""The docs-test markers and the command splitting of tests/e2e/docs_blocks.py, which
tests/e2e/test_docs_commands.py runs the docs' ```bash blocks with."""

from __future__ import annotations

import pytest

from tests.e2e.docs_blocks import MarkerError, parse_file, split_commands


def blocks(tmp_path, text: str):
    (tmp_path / "page.md").write_text(text)
    return parse_file(tmp_path / "page.md", "page.md")


def test_commands_keep_continuations_quotes_and_heredocs_and_drop_comments():
    text = (
        "# a comment\n"
        "fitlm train a.yaml \\\n"
        "  --set x=1   # trailing\n"
        "\n"
        "python -c \"print('it''s')\n"
        'print(2)"\n'
        "python - <<'PY'\n"
        "# not a comment: python\n"
        "PY\n"
        'echo "# not a comment"  # it\'s a comment\n'
        "ls\n"
    )
    cmds = split_commands(text, 10)
    assert [c.line for c in cmds] == [11, 14, 16, 19, 20]
    assert cmds[0].text.endswith("# trailing") and cmds[2].text.endswith("\nPY")


def test_markers_skip_set_sub_fail_and_after(tmp_path):
    (b1, b2) = blocks(
        tmp_path,
        "<!-- docs-test: after README.md; set train.max_steps=3; sub big => small; "
        "skip-line pip install (installs; packages); fails --bad (refused) -->\n"
        "```bash\n"
        "pip install x\n"
        "fitlm train big.yaml   # note\n"
        "fitlm plan big.yaml --bad\n"
        "```\n"
        "\n"
        "<!-- docs-test: skip (a GPU (one)) -->\n"
        "```bash\n"
        "nvidia-smi\n"
        "```\n",
    )
    assert b1.after == "README.md" and b2.skip == "a GPU (one)"
    pip, train, plan = b1.commands
    assert pip.skip == "installs; packages" and train.skip is None and plan.fails == "refused"
    assert train.text == "fitlm train small.yaml --set train.max_steps=3  # note"
    assert b2.commands[0].skip == "a GPU (one)"


@pytest.mark.parametrize(
    "marker",
    [
        "skip",  # no reason
        "skip-line pip",  # no reason
        "sub nowhere => x",  # matches nothing
        "skip-line nowhere (why)",  # matches nothing
        "frobnicate",  # unknown
    ],
)
def test_a_marker_that_cannot_be_honoured_is_refused(tmp_path, marker):
    with pytest.raises(MarkerError):
        blocks(tmp_path, f"<!-- docs-test: {marker} -->\n```bash\npip install x\n```\n")


def test_a_marker_must_stand_right_before_a_bash_block(tmp_path):
    with pytest.raises(MarkerError, match="right before"):
        blocks(tmp_path, "<!-- docs-test: skip (why) -->\nsome prose\n```bash\nls\n```\n")
    assert blocks(tmp_path, "    <!-- docs-test: an example -->\n```bash\nls\n```\n")[0].skip is None
