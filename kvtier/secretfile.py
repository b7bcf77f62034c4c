"""Secrets read from a file or an environment variable (the tenant secret, the master
encryption key): one a line in the file, ``#`` comments and blank lines skipped, or
``;``-separated in the variable. Pure; any thread."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def secret_lines(path: Path | None, env_var: str, what: str,
                 error: type[ValueError], environ: Mapping[str, str] | None = None,
                 ) -> tuple[list[str], str]:
    """``(secrets as text, where they came from)``: from ``path`` if given (``error``
    naming ``what`` if it cannot be read or holds none), else from ``env_var`` (maybe
    none)."""
    if path is None:
        env = os.environ if environ is None else environ
        return [s.strip() for s in env.get(env_var, "").split(";") if s.strip()], env_var
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{what} file {path}: cannot be read ({e})") from None
    found = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.strip().startswith("#")]
    if not found:
        raise error(f"{what} file {path} holds none: write one on a line")
    return found, str(path)
