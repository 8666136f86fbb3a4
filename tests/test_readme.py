"""The README's examples run as written: the Python example from the folder that holds a clone
(a `draftgraph/` directory there must not shadow the installed package), the `generate` lines
with the shipped prompts file, and the `serve` + `bench serve` pair (small --max-tokens /
--num-prompts appended: argparse keeps the last value of a repeated flag)."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from draftgraph.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def use_lines(subcommand: str) -> list[list[str]]:
    """argv after `draftgraph` (the subcommand first) of the README's "Use" lines."""
    use = README[README.index("## Use"):]
    block = re.search(r"```bash\n(.*?)```", use, re.S).group(1)
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [argv[1:] for argv in lines if argv[:2] == ["draftgraph", subcommand]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_python_example_runs_from_the_folder_holding_a_clone(tmp_path, default_gguf_path):
    (tmp_path / "draftgraph" / "src" / "draftgraph").mkdir(parents=True)  # an (empty) clone
    (python,) = code_blocks("python")
    assert "temperature=" in python  # the example sets its own temperature
    code = python + "\nimport draftgraph\nprint('PACKAGE', draftgraph.__file__)\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    text, _, rest = r.stdout.partition("{'prompt_tokens'")
    assert text.strip(), r.stdout  # the limerick
    assert "'completion_tokens': " in rest and "'accept_len_mean'" in rest  # ngram metrics
    package = r.stdout.rsplit("PACKAGE ", 1)[1].strip()
    assert package.endswith(str(Path("src", "draftgraph", "__init__.py")))
    assert not package.startswith(str(tmp_path))


def test_readme_generate_lines_run_with_the_shipped_prompts_file(monkeypatch, capsys,
                                                                  default_gguf_path):
    monkeypatch.chdir(ROOT)
    lines = use_lines("generate")
    assert len(lines) >= 3 and any("--prompts-file" in argv for argv in lines)
    for argv in lines:
        rc = main([*argv, "--max-tokens", "6"])
        out, err = capsys.readouterr()
        assert rc == 0, (argv, err[-2000:])
        summary = err.strip().splitlines()[-1]
        assert summary.startswith("draftgraph: ") and " tok/s" in summary, summary
        if "--speculative" in argv:
            assert "accept length" in summary
        if "--prompts-file" in argv:
            path = ROOT / argv[argv.index("--prompts-file") + 1]
            prompts = [json.loads(line)["prompt"] for line in path.read_text().splitlines()
                       if line.strip()]
            rows = [json.loads(line) for line in out.splitlines()]
            assert [row["prompt"] for row in rows] == prompts
            assert all(1 <= len(row["token_ids"]) <= 6 for row in rows)
        elif "--prompt-ids" in argv:
            ids = out.strip().splitlines()[-1].split()
            assert 1 <= len(ids) <= 6 and all(t.isdigit() for t in ids)
        else:
            assert out.strip(), argv


def test_readme_serve_and_bench_lines_run(tmp_path, capsys, default_gguf_path):
    (serve,) = use_lines("serve")
    (bench,) = use_lines("bench")
    port = str(free_port())
    readme_port = serve[serve.index("--port") + 1]
    serve = [port if w == readme_port else w for w in serve]
    bench = [w.replace(f":{readme_port}", f":{port}") for w in bench]
    server = subprocess.Popen([sys.executable, "-m", "draftgraph.cli", *serve],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        import httpx

        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        rc = main([*bench, "--num-prompts", "2", "--output-len", "6", "--num-warmups", "0",
                   "--result-dir", str(tmp_path), "--result-file", "readme.json"])
        assert rc == 0, capsys.readouterr().err[-2000:]
    finally:
        server.terminate()
        server.wait(timeout=30)
    data = json.loads((tmp_path / "readme.json").read_text())
    levels = [int(w) for w in bench[bench.index("--max-concurrency") + 1:] if w.isdigit()]
    assert [r["max_concurrency"] for r in data["results"]] == levels
    assert all(r["completed"] == 2 and r["failed"] == 0 for r in data["results"])
    assert data["server"]["speculative"] == "ngram"
