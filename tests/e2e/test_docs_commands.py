"""Every command in README.md and docs/*.md runs (issue 51). Each file's ```bash blocks run in document order in
one bash session, as a reader's shell would, in a scratch working copy (configs/ and examples/ copied, `.venv`
linked to this interpreter's environment): nothing is written into the repository. A block that cannot run here
(a GPU, a cluster, a hub download, a long-running server) carries a `<!-- docs-test: ... -->` marker saying
why; step counts and paths that differ from the page are the marker's explicit `set` and `sub` directives
(tests/e2e/docs_blocks.py, docs/testing.md). A failing command fails its file's test with its file:line, the
command and the tail of its output. Assertions are on exit status only: the commands' text is others' to change.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.docs_blocks import ROOT, Block, all_blocks, table

BLOCKS = all_blocks()
RUN = [name for name, blocks in BLOCKS.items() if any(c.skip is None for b in blocks for c in b.commands)]
TIMEOUT = 540  # seconds per file (under pytest-timeout's 600); the whole harness takes about 4 CPU minutes
TAIL = 40  # lines of output shown for a failing command


def prerequisite(name: str) -> str | None:
    afters = {b.after for b in BLOCKS[name] if b.after}
    assert len(afters) <= 1, f"{name}: its blocks name more than one `after`: {sorted(afters)}"
    return afters.pop() if afters else None


def depth(name: str) -> int:
    before = prerequisite(name)
    return 0 if before is None or before not in BLOCKS else 1 + depth(before)


RUN.sort(key=depth)  # a file's prerequisite runs in its own test, before it


def script(blocks: list[Block]) -> tuple[str, dict[str, str]]:
    """The bash session of a file's blocks: each command announced by `@@docs-test FILE:LINE`, and the session
    stopped at the first that fails (also within an `a && b` list, which `set -e` lets pass)."""
    lines, commands = ["set -o pipefail"], {}
    for block in blocks:
        for cmd in block.commands:
            if cmd.skip is None:
                where = f"{block.file}:{cmd.line}"
                commands[where] = cmd.text
                lines.append(f"echo '@@docs-test {where}'")
                if cmd.fails is None:
                    lines += [cmd.text, '__rc=$?; if [ "$__rc" -ne 0 ]; then exit "$__rc"; fi']
                else:  # a documented refusal: it must fail
                    lines += [
                        "if {",
                        cmd.text,
                        "}; then echo 'docs-test: this command exited 0, but its marker says it fails'; exit 1; fi",
                    ]
    return "\n".join(lines) + "\n", commands


def failure(name: str, output: str, commands: dict[str, str], why: str) -> str:
    lines = output.splitlines()
    marks = [n for n, line in enumerate(lines) if line.startswith("@@docs-test ") and ":" in line]
    where = lines[marks[-1]].split()[1] if marks else name
    tail = "\n".join(lines[marks[-1] + 1 if marks else 0 :][-TAIL:])  # the failing command's own output
    return f"{where}: {why}\n$ {commands.get(where, '?')}\n--- output tail ---\n{tail}"


def tiny_models(root: Path) -> dict[str, str]:
    """The checkpoints the README's family block brings, made tiny: a Qwen2 HF directory (transformers, Qwen's
    tokenizer) and a Llama 3 GGUF file (q8_0, Llama 3's tokenizer and chat template) through fitlm itself."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from fitlm.cli import main
    from tests.unit.model_tokenizers import hf_dir

    dirs = {}
    for name, model_type, style in (("qwen", "qwen2", "qwen"), ("llama", "llama", "llama3")):
        tok_dir = hf_dir(style, root / f"{name}-tok")
        tok = AutoTokenizer.from_pretrained(tok_dir)
        specials = {
            k: tok.convert_tokens_to_ids(v)
            for k, v in (("bos_token_id", tok.bos_token), ("eos_token_id", tok.eos_token))
            if v is not None
        }
        shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
        cfg = AutoConfig.for_model(
            model_type, vocab_size=len(tok), intermediate_size=128, max_position_embeddings=128, **shape, **specials
        )
        d = root / f"{name}-hf"
        AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
        for f in tok_dir.iterdir():
            shutil.copy(f, d / f.name)
        dirs[name] = d
    gguf = root / "llama-q8_0.gguf"
    assert main(["import", str(dirs["llama"]), "--out", str(root / "llama-fitlm")]) == 0
    assert main(["export", str(root / "llama-fitlm"), "--format", "gguf", "--dtype", "q8_0", "--out", str(gguf)]) == 0
    return {"DOCS_TINY_QWEN_HF": str(dirs["qwen"]), "DOCS_TINY_LLAMA_GGUF": str(gguf)}


class Workdirs:
    """Each file's scratch working copy after its blocks ran, made once per module: a file whose blocks name
    `after FILE` starts from a copy of FILE's."""

    def __init__(self, tmp: Path):
        self.tmp, self.done, self.env = tmp, {}, None

    def environment(self, text: str) -> dict[str, str]:
        if self.env is None:
            bindir = str(Path(sys.executable).parent)
            self.env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
        if "$DOCS_TINY_" in text and "DOCS_TINY_QWEN_HF" not in self.env:
            self.env.update(tiny_models(self.tmp / "models"))
        return self.env

    def run(self, name: str) -> tuple[Path, str | None]:
        if name not in self.done:
            self.done[name] = self._run(name)
        return self.done[name]

    def _run(self, name: str) -> tuple[Path, str | None]:
        work = self.tmp / name.replace("/", "_").removesuffix(".md")
        before = prerequisite(name)
        if before is not None:
            base, error = self.run(before)
            if error is not None:
                return work, f"{name} runs after {before}, which failed:\n{error}"
            shutil.copytree(base, work, symlinks=True)
        else:
            work.mkdir()
            for d in ("configs", "examples"):
                shutil.copytree(ROOT / d, work / d)
            if sys.prefix != sys.base_prefix:  # the README's `source .venv/bin/activate`
                (work / ".venv").symlink_to(sys.prefix)
        text, commands = script(BLOCKS[name])
        (work / ".docs-test.sh").write_text(text)
        try:
            proc = subprocess.run(
                ["bash", ".docs-test.sh"],
                cwd=work,
                env=self.environment(text),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=TIMEOUT,
            )
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
            return work, failure(name, out, commands, f"still running after {TIMEOUT} s")
        (work / ".docs-test.out").write_text(proc.stdout)  # the session's whole output, beside its script
        if proc.returncode != 0:
            why = f"failed with exit status {proc.returncode} (whole output: {work / '.docs-test.out'})"
            return work, failure(name, proc.stdout, commands, why)
        return work, None


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory) -> Workdirs:
    return Workdirs(tmp_path_factory.mktemp("docs"))


def test_every_block_is_run_or_marked_with_a_reason():
    """all_blocks() refused any marker it cannot honour (an unknown directive, a skip without its reason, a `sub`
    or `skip-line` matching nothing); every command left out names why, and the table says which."""
    print(table(BLOCKS))
    skipped = [c for blocks in BLOCKS.values() for b in blocks for c in b.commands if c.skip is not None]
    assert all(c.skip.strip() for c in skipped)
    assert "README.md" in RUN and sum(len(b) for b in BLOCKS.values()) > 10
    for name in RUN:
        assert prerequisite(name) in (None, *BLOCKS), f"{name}: `after` names no docs file"


def test_no_shell_block_escapes_the_harness():
    """The harness runs ```bash blocks: a shell block under another language tag would be read by no one."""
    for name in BLOCKS:
        for n, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            tag = line.strip().removeprefix("```")
            assert not (line.strip().startswith("```") and tag in ("sh", "shell", "console", "zsh")), (
                f"{name}:{n}: ```{tag}: write shell commands as ```bash blocks (tests/e2e/test_docs_commands.py)"
            )


@pytest.mark.slow
@pytest.mark.parametrize("name", RUN)
def test_docs_commands_run(workdirs, name):
    work, error = workdirs.run(name)
    if error is not None:
        pytest.fail(error, pytrace=False)
