"""``p2ptrain monitor``'s input errors: one line and exit code 2, before anything starts."""

from __future__ import annotations

from click.testing import CliRunner

from p2ptrain.cli import main


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["monitor", *args])
    return result.exit_code, result.output


def test_bad_input_is_one_line_and_exit_code_2(tmp_path):
    code, out = run("--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
    assert code == 2 and "--run NAME" in out and len(out.strip().splitlines()) == 1
    code, out = run("--run", "demo")
    assert code == 2 and "--initial-peers MADDR" in out
    code, out = run("--run", "bad.run", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
    assert code == 2 and "invalid run ID" in out
    code, out = run("--run", "demo", "--initial-peers", "/ip4/127.0.0.1/tcp/1")
    assert code == 2 and "/p2p/" in out
    config = tmp_path / "monitor.toml"
    config.write_text('run = "from-file"\nport = 0\n[dht]\nrequest_timeout_s = 5.0\n')
    code, out = run("--config", str(config))  # the file was read: only the initial peers are missing
    assert code == 2 and "--initial-peers MADDR" in out
    config.write_text('run = "demo"\ncolour = "blue"\n')
    code, out = run("--config", str(config))
    assert code == 2 and "unknown config key colour" in out
