"""Saved contexts: a gateway's URL, a bearer token and a default pool under a name, kept in
`$XDG_CONFIG_HOME/computepool/config.toml` (mode 0600, replaced atomically), one current.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

CONFIG_FILE = "config.toml"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ContextError(Exception):
    """A context the command line names that cannot be used."""

    code = "context_error"


class UnknownContext(ContextError):
    """No context of that name is saved."""

    code = "unknown_context"


class BadConfig(ContextError):
    """The config file is not TOML, or not the shape this version writes."""

    code = "bad_config"


@dataclass(frozen=True)
class Context:
    """One gateway and the token that speaks there; `tenant` is what the token said it was
    when it was saved (empty: the admin's)."""

    name: str
    url: str
    token: str
    tenant: str = ""
    pool: str = ""


@dataclass(frozen=True)
class Config:
    current: str = ""
    contexts: dict[str, Context] = field(default_factory=dict)

    def pick(self, name: str | None) -> Context | None:
        """The context named (an unknown name is an error), else the current one, if any."""
        if name:
            if name not in self.contexts:
                known = ", ".join(sorted(self.contexts)) or "none saved: `pool login URL`"
                raise UnknownContext(f"no context named {name!r} ({known})")
            return self.contexts[name]
        return self.contexts.get(self.current) if self.current else None

    def with_context(self, ctx: Context, *, use: bool = True) -> Config:
        contexts = {**self.contexts, ctx.name: ctx}
        return replace(self, contexts=contexts, current=ctx.name if use else self.current)

    def without(self, name: str) -> Config:
        if name not in self.contexts:
            raise UnknownContext(f"no context named {name!r}")
        contexts = {k: v for k, v in self.contexts.items() if k != name}
        return Config(current="" if self.current == name else self.current, contexts=contexts)


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "computepool" / CONFIG_FILE


def load(path: Path | None = None) -> Config:
    path = path or config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Config()
    except (UnicodeDecodeError, OSError) as e:
        raise BadConfig(f"{path}: {e}") from None
    import tomllib  # only where there is a file to read: a `pool` without contexts skips it

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise BadConfig(f"{path}: {e}") from None
    contexts: dict[str, Context] = {}
    table = data.get("contexts", {})
    if not isinstance(table, dict):
        raise BadConfig(f"{path}: [contexts] is not a table")
    for name, body in table.items():
        if not isinstance(body, dict) or not all(isinstance(body.get(k, ""), str)
                                                 for k in ("url", "token", "tenant", "pool")):
            raise BadConfig(f"{path}: context {name!r} is not a table of strings")
        contexts[name] = Context(name=name, url=body.get("url", ""), token=body.get("token", ""),
                                 tenant=body.get("tenant", ""), pool=body.get("pool", ""))
    current = data.get("current-context", "")
    return Config(current=current if isinstance(current, str) else "", contexts=contexts)


def _string(value: str) -> str:
    # a JSON string is a TOML basic string as long as it holds no surrogate escapes, which
    # ensure_ascii=False never writes
    return json.dumps(value, ensure_ascii=False)


def dumps(config: Config) -> str:
    lines = ["# computepool contexts (`pool login`, `pool context …`): holds tokens, keep private",
             f"current-context = {_string(config.current)}"]
    for name in sorted(config.contexts):
        ctx = config.contexts[name]
        lines += ["", f"[contexts.{_string(name)}]", f"url = {_string(ctx.url)}",
                  f"token = {_string(ctx.token)}", f"tenant = {_string(ctx.tenant)}",
                  f"pool = {_string(ctx.pool)}"]
    return "\n".join(lines) + "\n"


def save(config: Config, path: Path | None = None) -> Path:
    """Write the whole file readable by its owner only, replacing the old one atomically (a
    reader sees the old file or the new, never half of one)."""
    path = path or config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dumps(config))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
