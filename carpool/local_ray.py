"""The one-box Ray that ``make serve`` starts: closed to the network, and always its own.

Ray 2.60 binds its gRPC servers (GCS, raylet, workers, Serve replicas) to every address and
its dashboard agent to the node's address, and with ``RAY_AUTH_MODE=disabled`` its agent runs
a shell command posted to ``/api/job_agent/jobs/`` by anyone who can reach the machine (the
ShadowRay class of hole). On one box carpool closes that twice:

- **Token auth** (``RAY_AUTH_MODE=token``): the token lives in Ray's default file,
  ``~/.ray/auth_token`` (``RAY_AUTH_TOKEN_PATH`` moves it), created here once with owner-only
  permissions before Ray starts (Ray's own writer leaves it world-readable). Every ``ray`` and
  ``serve`` CLI call and the tests find it there with no hand step; the dashboard asks for it
  once per browser (``ray get-auth-token`` prints it).
- **Loopback**: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is Ray's single-machine mode (its
  default on macOS and Windows): the node address is 127.0.0.1, so the GCS, raylet, workers,
  agents and replicas listen on loopback only, and a second node cannot join. Only a one-box
  Ray gets it; the cluster configs run Ray's cluster mode with token auth.

``serve run --address local`` then starts a Ray of its own whatever another run left behind:
without it, ``serve run`` joins the address in ``/tmp/ray/ray_current_cluster``, which a
stopped ``ray start --head`` (a benchmark's) leaves pointing at a dead GCS, and retries for
minutes. ``preflight`` names what holds a port ``make serve`` needs, within a second.

Nothing here imports Ray: it runs before Ray starts, in the Makefile's recipe.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import socket
import stat
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

AUTH_MODE_VAR = "RAY_AUTH_MODE"
TOKEN_PATH_VAR = "RAY_AUTH_TOKEN_PATH"
# Ray's switch for its single-machine mode (ray/_private/ray_constants.py): off, the node's
# address is the loopback one and `ray start --address` refuses to add a node.
CLUSTER_MODE_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
OWNER_ONLY = 0o600
UNSAFE_WARNING = (
    "RAY_AUTH_MODE={mode}: Ray's token auth is off, so any local user (and, on a cluster, any "
    "host that reaches Ray's ports) can submit jobs, that is run shell commands as you. Keep it "
    "off only on a machine and network you trust; unset it to get token auth back."
)


def token_path(env: Mapping[str, str] | None = None) -> Path:
    """Where Ray reads its token: ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``."""
    env = os.environ if env is None else env
    explicit = env.get(TOKEN_PATH_VAR)
    return Path(explicit).expanduser() if explicit else Path.home() / ".ray" / "auth_token"


def ensure_token(path: Path) -> Path:
    """Creates Ray's token file once (256 random bits, as Ray's own generator), readable by its
    owner only; an existing token is kept and its permissions narrowed to the owner's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # O_EXCL: never overwrite a token a running cluster or another shell already uses.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, OWNER_ONLY)
    except FileExistsError:
        if not path.read_text().strip():
            raise ValueError(
                f"{path} is empty: Ray would refuse it; delete it and run this again"
            ) from None
    else:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32))
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        path.chmod(OWNER_ONLY)
    return path


def ray_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables a one-box Ray must start with; the caller's ``RAY_AUTH_MODE`` wins (it may
    turn token auth off, at its own risk: ``UNSAFE_WARNING``)."""
    env = os.environ if env is None else env
    mode = env.get(AUTH_MODE_VAR) or "token"
    values = {AUTH_MODE_VAR: mode, CLUSTER_MODE_VAR: "0"}
    if mode == "token":
        values[TOKEN_PATH_VAR] = str(ensure_token(token_path(env)))
    return values


def listening_sockets() -> dict[str, tuple[str, int]]:
    """Every TCP socket in LISTEN state on this host, ``{inode: (address, port)}``, from
    /proc/net/tcp{,6} (addresses as the kernel holds them: ``0.0.0.0``, ``::``,
    ``::ffff:127.0.0.1``...)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                address, port = fields[1].rsplit(":", 1)
                found[fields[9]] = (_hex_address(address), int(port, 16))
    return found


def _hex_address(text: str) -> str:
    """An address of /proc/net/tcp{,6}: little-endian 32-bit words, as text."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(words) == 4 else socket.AF_INET6, words)


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets ``pid`` holds open (empty once it is gone, or another
    user's)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def port_holder(port: int, host: str = "127.0.0.1") -> str | None:
    """Who listens on ``host:port`` (pid and command line where /proc shows them), or None
    when the port is free."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            return None
        except OSError:
            pass
    inodes = {inode for inode, (_, p) in listening_sockets().items() if p == port}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if socket_inodes(int(pid)) & inodes:
            try:
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                raw = b""
            command = " ".join(raw.replace(b"\0", b" ").decode(errors="replace").split())
            return f"pid {pid} ({command[:120] or '?'})"
    return "a process this user cannot see"


def preflight(ports: Sequence[int]) -> list[str]:
    """What is in the way of a new one-box Ray, each with how to clear it (empty: nothing)."""
    problems = []
    for port in ports:
        holder = port_holder(port)
        if holder is not None:
            problems.append(
                f"127.0.0.1:{port} is taken by {holder}: stop it (an earlier `make serve`: "
                "Ctrl-C it or run `make stop`), or free the port, then run `make serve` again"
            )
    return problems


def http_port(config: Path) -> int:
    """The HTTP port a serve config listens on (Serve's default 8000 when it names none)."""
    import yaml

    data = yaml.safe_load(config.read_text()) or {}
    return int((data.get("http_options") or {}).get("port", 8000))


def _cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m carpool.local_ray", description=__doc__)
    parser.add_argument("command", choices=["env"], help="print the exports for `serve run`")
    parser.add_argument("config", type=Path, help="the serve config `make serve` runs")
    args = parser.parse_args(argv)
    problems = preflight([http_port(args.config)])
    if problems:
        print("make serve cannot start its own Ray:\n- " + "\n- ".join(problems), file=sys.stderr)
        return 2
    try:
        values = ray_environment()
    except (OSError, ValueError) as exc:
        print(f"Ray's token file: {exc}", file=sys.stderr)
        return 2
    if values[AUTH_MODE_VAR] != "token":
        print("WARNING: " + UNSAFE_WARNING.format(mode=values[AUTH_MODE_VAR]), file=sys.stderr)
    for key, value in values.items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_cli())
