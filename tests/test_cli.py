"""The kvtier command: exit codes and messages as a careful CLI has them."""

from __future__ import annotations

import os
import time
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


def test_check_passes_with_a_small_host_pool_and_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A valid config whose host pool holds fewer probes than ``--count`` (16 MiB: four
    4 MiB chunks, 16 probes by default) passes: the probes are written and read back in
    batches that fit (issue 32 review item 10: they evicted each other and the check
    failed with "host: probe read back wrong or missing")."""
    cfg = _cfg(tmp_path, f"""
tiers:
  - host: {{capacity: 16MiB}}
  - file: {{path: {tmp_path / 'store'}, capacity: 20MiB}}
""")
    assert main(["check", cfg]) == EXIT_OK
    out = capsys.readouterr().out
    assert "check passed" in out and "host" in out and "file1" in out
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


def test_a_missing_shared_directory_exits_3_and_is_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = tmp_path / "mnt" / "nfs" / "kvtier-pd"  # the mount is missing
    cfg = _cfg(tmp_path, f"""
tiers:
  - host: {{capacity: 8MiB}}
  - file: {{path: {shared}, capacity: 1GiB, write: through}}
""")
    assert main(["check", cfg, "--chunk-size", "1MiB"]) == EXIT_RESOURCE
    err = capsys.readouterr().err
    assert "tiers[1].file.path" in err and "does not exist" in err and "mount" in err
    assert not (tmp_path / "mnt").exists()


def test_the_shipped_pd_config_fails_clearly_without_its_share(
    capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = Path(__file__).resolve().parent.parent / "configs" / "pd-shared.yaml"
    if Path("/mnt/nfs").exists():
        pytest.skip("/mnt/nfs exists on this machine")
    assert main(["stats", str(cfg)]) == EXIT_RESOURCE
    assert "tiers[1].file.path: /mnt/nfs/kvtier-pd does not exist" in capsys.readouterr().err


def test_a_misplaced_secret_is_not_echoed(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzSECRETKEY"
    cfg = _cfg(tmp_path, f"""
tiers:
  - host: {{capacity: 8MiB}}
  - file: {{path: {tmp_path}, capacity: 1GiB, aws_secret_access_key: {secret}}}
""")
    assert main(["check", cfg]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "tiers[1].file.aws_secret_access_key: unknown key" in err
    assert secret not in err


def test_gc_reports_stale_temp_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.tiers.file import FileTier
    from tests.tiers.harness import make_key

    tier = FileTier(tmp_path / "store", 1 << 30)
    leaf = tier.path_of(make_key(0)).parent
    leaf.mkdir(parents=True)
    stale, young = leaf / ".a.kv.dead-1.0001.tmp", leaf / ".b.kv.live-2.0002.tmp"
    for p in (stale, young):
        p.write_bytes(b"x" * 100)
    long_ago = time.time() - 700  # past file.temp_grace_seconds (600)
    os.utime(stale, (long_ago, long_ago))
    cfg = _cfg(tmp_path, f"""
tiers:
  - host: {{capacity: 8MiB}}
  - file: {{path: {tmp_path / 'store'}, capacity: 1GiB, temp_grace_seconds: 600}}
""")
    assert main(["gc", cfg]) == EXIT_OK
    assert "removed 1 stale temp files" in capsys.readouterr().out
    assert not stale.exists() and young.exists()


@pytest.mark.s3
def test_check_reports_the_conditionals_an_s3_endpoint_honours(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    from tests.tiers.s3_harness import BUCKET, fresh_prefix, moto_honours, shared_endpoint

    endpoint = shared_endpoint(request.config)  # moto
    body = """
tiers:
  - host: {{capacity: 64MiB}}
  - s3: {{bucket: {b}, prefix: {p}, endpoint_url: "{e}", region: us-east-1, capacity: 1GiB{x}}}
"""
    cfg = _cfg(tmp_path, body.format(b=BUCKET, p=fresh_prefix(), e=endpoint, x=""))
    assert main(["check", cfg, "--chunk-size", "64KiB", "--count", "2"]) == EXIT_OK
    out = capsys.readouterr().out
    batch = "yes" if moto_honours()[3] else "no"
    assert ("s31: conditionals (probed): PutObject If-None-Match yes, CompleteMultipartUpload "
            f"If-None-Match yes, DeleteObject If-Match yes, DeleteObjects ETag {batch}, "
            "CopyObject CopySourceIfMatch no") in out
    assert "check passed" in out
    trusted = body.format(b=BUCKET, p=fresh_prefix(), e=endpoint, x=", conditionals: trusted")
    assert main(["check", _cfg(tmp_path, trusted), "--chunk-size", "64KiB", "--count", "2"]) == 0
    assert "s31: conditionals (trusted (config)): PutObject If-None-Match yes" in (
        capsys.readouterr().out)


def test_purge_removes_exactly_the_given_namespaces(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``kvtier namespaces`` lists what the tiers hold by namespace (a tenant's salt, a
    model, an adapter, a weights epoch each make one); ``kvtier purge`` is a dry run
    unless ``--yes``, then removes every object of the given namespaces and none other."""
    from kvtier.tiers.file import FileTier
    from tests.tiers.harness import make_key, meta_for, payload_for

    tenant_a, tenant_b = b"a" * 16, b"b" * 16
    tier = FileTier(tmp_path / "store", 1 << 30)
    for i in range(5):
        ns = tenant_a if i < 3 else tenant_b
        tier.put(meta_for(make_key(i), namespace=ns), payload_for(make_key(i)).data)
    tier.close()
    cfg = _cfg(tmp_path, f"""
tiers:
  - host: {{capacity: 64MiB}}
  - file: {{path: {tmp_path / 'store'}, capacity: 1GiB}}
""")
    assert main(["namespaces", cfg]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"{tenant_a.hex()}\t3\t" in out and f"{tenant_b.hex()}\t2\t" in out
    assert main(["purge", cfg, "--namespace", tenant_a.hex()]) == EXIT_OK
    assert "3 objects" in (out := capsys.readouterr().out) and "dry run" in out
    assert main(["purge", cfg, "--namespace", tenant_a.hex(), "--yes"]) == EXIT_OK
    assert "removed 3" in capsys.readouterr().out
    assert main(["namespaces", cfg]) == EXIT_OK
    out = capsys.readouterr().out
    assert tenant_a.hex() not in out and f"{tenant_b.hex()}\t2\t" in out
    assert main(["purge", cfg, "--namespace", "not-hex"]) == EXIT_USAGE
    assert "not a hex digest" in capsys.readouterr().err
