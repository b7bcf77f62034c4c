"""The kvtier command: exit codes and messages as a careful CLI has them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli import EXIT_OK, EXIT_RESOURCE, EXIT_USAGE, main


def _cfg(tmp: Path, body: str) -> str:
    p = tmp / "kvtier.yaml"
    p.write_text(body)
    return str(p)


def test_check_probes_every_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _cfg(tmp_path, f"""
tiers:
  - host: {{capacity: 64MiB}}
  - file: {{path: {tmp_path / 'store'}, capacity: 1GiB}}
""")
    assert main(["check", cfg, "--chunk-size", "1MiB", "--count", "4"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "host" in out and "file1" in out and "check passed" in out
    assert main(["stats", cfg]) == EXIT_OK
    assert " 0 " in capsys.readouterr().out  # probes were deleted


def test_ls_and_gc(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.tiers.file import FileTier
    from tests.tiers.harness import make_key, meta_for, payload_for

    tier = FileTier(tmp_path / "store", 1 << 30)
    for i in range(3):
        tier.put(meta_for(make_key(i)), payload_for(make_key(i)).data)
    cfg = _cfg(tmp_path, f"""
tiers:
  - host: {{capacity: 64MiB}}
  - file: {{path: {tmp_path / 'store'}, capacity: 100KiB}}
""")
    assert main(["ls", cfg]) == EXIT_OK
    assert capsys.readouterr().out.count(make_key(0).hex()) == 1
    assert main(["gc", cfg]) == EXIT_OK
    assert "now 1 objects" in capsys.readouterr().out


def test_bad_config_exits_2_naming_the_field(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _cfg(tmp_path, "tiers:\n  - host: {capacity: lots}\n")
    assert main(["check", cfg]) == EXIT_USAGE
    assert "tiers[0].host.capacity" in capsys.readouterr().err


def test_unusable_directory_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    cfg = _cfg(tmp_path, f"""
tiers:
  - host: {{capacity: 8MiB}}
  - file: {{path: {blocker}, capacity: 1GiB}}
""")
    assert main(["check", cfg, "--chunk-size", "1MiB"]) == EXIT_RESOURCE
    assert "tiers[1].file.path" in capsys.readouterr().err
