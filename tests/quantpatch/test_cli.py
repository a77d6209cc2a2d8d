"""The README's first command: ``quantpatch compare`` on embedded inputs."""

import pytest

from quantpatch import cli_commands
from quantpatch.cli import build_parser, compare


def test_compare_runs_every_mode_on_embedded_inputs():
    argv = ["compare", "--seq-len", "96", "--heads", "2", "--kv-heads", "1", "--device", "cpu"]
    args = build_parser().parse_args(argv)
    rows = compare(args)
    assert [r["mode"] for r in rows] == ["fireq", "int8-flash", "sage2-4b", "sage2-8b", "turbo"]
    assert all(r["cos_sim"] > 0.99 for r in rows)


def test_console_entry_reads_sys_argv(monkeypatch, capsys):
    from quantpatch.cli import main

    monkeypatch.setattr("sys.argv", ["quantpatch", "info", "--help"])
    try:
        main()
    except SystemExit as exit_:
        assert exit_.code == 0
    out = capsys.readouterr().out
    assert "usage: quantpatch info" in out and "CosSim" not in out


def test_eval_scripts_outside_a_source_checkout_give_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(cli_commands, "EVAL_DIR", tmp_path)  # what an installed wheel sees: no eval/ beside it
    with pytest.raises(SystemExit, match="ship with the source checkout"):
        cli_commands.load_eval_script("lm_eval_run.py")
