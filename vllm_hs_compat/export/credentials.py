"""The trainer's credential and every key derived from it: the token (its environment variables, its file and the
checks that refuse a file anyone else could have planted), the CURVE key pairs of producers and trainers, and the
plain channel's HMAC key.  Nothing here opens a socket."""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import stat
from pathlib import Path
from typing import Final, NoReturn

import zmq
from zmq.utils import z85

from vllm_hs_compat import envs
from vllm_hs_compat import errors as E

log = logging.getLogger("vllm_hs_compat.export.control")

MIN_TOKEN_CHARS: Final = 16


def new_token() -> str:
    """A fresh trainer token (``secrets.token_urlsafe(32)``)."""
    import secrets

    return secrets.token_urlsafe(32)


#: The trainer credential: the token itself, or the file holding it.
TOKEN_ENV = envs.EXPORT_TOKEN
TOKEN_FILE_ENV = envs.EXPORT_TOKEN_FILE


def default_token_file() -> Path:
    """``$VLLM_HS_COMPAT_EXPORT_TOKEN_FILE``, else ``~/.cache/vllm-hs-compat/export.token``."""
    env = os.environ.get(TOKEN_FILE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "vllm-hs-compat" / "export.token"


#: Longest token file read (a token is 43 characters; anything much longer is not one).
MAX_TOKEN_FILE_BYTES: Final = 4096
_FILE_OPEN: Final = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _token_fix(file: Path, chmod: bool) -> str:
    first = f"`chmod 600 {file}` if you wrote it yourself, else delete it" if chmod else f"delete {file}"
    return (
        f"fix: {first} (a fresh token is generated at the next producer start; restart the trainers too), or "
        f"pass the token in ${TOKEN_ENV} instead of a file"
    )


_KINDS: Final = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _describe(st: os.stat_result) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}"


def _private_group(gid: int) -> bool:
    """Whether ``gid`` is this user's private group (its primary group, named after the user, no other members):
    a group-writable directory of such a group is writable by this user only (Debian's ``umask 002``)."""
    import grp
    import pwd

    try:
        user = pwd.getpwuid(os.geteuid())
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == user.pw_gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def _check_token_dir(dfd: int, directory: Path, file: Path) -> None:
    """The rule for the token file's directory (checked on the open directory): owned by this user or root, and
    writable by no one else, i.e. no other-write bit and no group-write bit unless the sticky bit is set (then
    nobody else can rename or replace this user's file: ``/tmp``) or the group is this user's private group."""
    st = os.fstat(dfd)
    mode, uid = stat.S_IMODE(st.st_mode), os.geteuid()
    problem = None
    if st.st_uid not in (uid, 0):
        problem = f"owned by uid {st.st_uid} (expected this user, uid {uid}, or root)"
    elif mode & 0o002 and not mode & stat.S_ISVTX:
        problem = "writable by others without the sticky bit"
    elif mode & 0o020 and not mode & stat.S_ISVTX and not _private_group(st.st_gid):
        problem = f"writable by group {st.st_gid} without the sticky bit"
    if problem is not None:
        _refuse(
            f"token file {file}: its directory {directory} ({_describe(st)}) is {problem}, so someone else could "
            f"plant or swap the token file there; fix: `chmod go-w {directory}`, or keep the token file in a "
            f"directory of your own ({TOKEN_FILE_ENV}= or token_file=), or pass the token in ${TOKEN_ENV}"
        )


def _check_token_fd(fd: int, file: Path) -> None:
    """The rule for the token file itself (checked on the open descriptor, so no name swap can slip past): a
    regular file owned by this user with no group or other permission bits (``0600`` or ``0400``)."""
    st = os.fstat(fd)
    problem, chmod = None, False
    if not stat.S_ISREG(st.st_mode):
        problem = f"is {_KINDS.get(stat.S_IFMT(st.st_mode), 'a special file')}, not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif st.st_mode & 0o077:
        problem = "can be read or written by group or others (expected mode 0600 or 0400)"
        chmod = True
    elif st.st_size > MAX_TOKEN_FILE_BYTES:
        problem = f"has {st.st_size} bytes, more than a token ({MAX_TOKEN_FILE_BYTES} at most)"
    if problem is not None:
        _refuse(f"token file {file} ({_describe(st)}) {problem}; {_token_fix(file, chmod)}")


def _refuse(message: str) -> NoReturn:
    log.warning("refusing the export token file: %s", message)
    raise E.UnsafeTokenFileError(message)


def _no_token() -> E.ExportConfigError:
    """Neither the variable nor the token file."""
    return E.ExportConfigError(
        f"no export token: set {TOKEN_ENV}, or point {TOKEN_FILE_ENV} (or token_file=) at the token file the "
        f"serving worker writes (default {default_token_file()}; its path is logged at start-up)"
    )


def _open_dir(directory: Path) -> int:
    return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _read_token_at(dfd: int, file: Path) -> str | None:
    """The token in ``file`` (a name in the open directory ``dfd``), checked on the open file; None when there is
    no such file.  A symbolic link, a FIFO or a socket is refused without blocking."""
    try:
        fd = os.open(file.name, os.O_RDONLY | _FILE_OPEN, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):
            kind = "a symbolic link" if e.errno == errno.ELOOP else "a socket"
            _refuse(f"token file {file} is {kind}, not a regular file; {_token_fix(file, False)}")
        raise E.ExportConfigError(f"cannot read token file {file}: {e.strerror}") from None
    try:
        _check_token_fd(fd, file)
        data = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return check_token(data.decode().strip())
    except UnicodeDecodeError:
        raise E.ExportConfigError(f"token file {file} is not text; delete it or set ${TOKEN_ENV}") from None


def _create_token_at(dfd: int, file: Path) -> str:
    """A fresh token written to ``file`` (``0600``), or the token another producer wrote there first.  It is
    written under a temporary name, then linked into place (a link never replaces a file): a producer starting
    at the same moment finds either no file or the whole token, never an empty one."""
    tmp = f".{file.name}.{os.getpid()}.{new_token()[:8]}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_OPEN, 0o600, dir_fd=dfd)
    except OSError as e:
        raise E.ExportConfigError(
            f"cannot create token file {file}: {e.strerror}; make {file.parent} writable by this user, point "
            f"{TOKEN_FILE_ENV} (or token_file=) elsewhere, or set {TOKEN_ENV}"
        ) from None
    try:
        token = new_token()
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
        try:
            os.link(tmp, file.name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except FileExistsError:
            found = _read_token_at(dfd, file)
            if found is None:  # created and removed again in between: not worth a loop
                raise E.ExportConfigError(f"token file {file} appeared and vanished; start again") from None
            return found
        return token
    finally:
        os.close(fd)
        os.unlink(tmp, dir_fd=dfd)


def load_or_create_token(path: str | os.PathLike[str] | None = None) -> tuple[str, Path | None]:
    """The producer's token: ``$VLLM_HS_COMPAT_EXPORT_TOKEN`` if set, else the token file (created ``0600``, in
    a directory created ``0700``, with a fresh token when absent, so every producer of one deployment and its
    trainers share it).  Returns the token and the file it lives in (None when it came from the environment).

    A token file (or directory) someone else could have read or planted is refused with
    :class:`~vllm_hs_compat.errors.UnsafeTokenFileError`, never adopted: see :func:`read_token` for the rule;
    a new directory's mode is checked too (``mkdir`` modes are masked by the umask and an existing directory
    keeps its own)."""
    env = os.environ.get(TOKEN_ENV)
    if env:
        return check_token(env), None
    file = Path(path) if path is not None else default_token_file()
    try:
        file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        dfd = _open_dir(file.parent)
    except OSError as e:
        raise E.ExportConfigError(
            f"cannot create the token file's directory {file.parent}: {e.strerror}; point {TOKEN_FILE_ENV} (or "
            f"token_file=) elsewhere, or set {TOKEN_ENV}"
        ) from None
    try:
        _check_token_dir(dfd, file.parent, file)
        found = _read_token_at(dfd, file)
        return (found if found is not None else _create_token_at(dfd, file)), file
    finally:
        os.close(dfd)


def read_token(path: str | os.PathLike[str] | None = None) -> str:
    """The trainer credential: ``$VLLM_HS_COMPAT_EXPORT_TOKEN``, else the token file (``path``, or
    :func:`default_token_file`).  Raises :class:`ExportConfigError` naming both when neither exists.

    The token file is refused (:class:`~vllm_hs_compat.errors.UnsafeTokenFileError`, naming the file, what was
    found and the fix) unless it is a regular file (not a link: opened with ``O_NOFOLLOW`` and checked on the open
    descriptor) owned by this user with no group/other permission bits (``0600``/``0400``), in a directory owned by
    this user or root that no one else can write (no group/other write bit, unless the sticky bit is set or the
    group is the user's private group)."""
    env = os.environ.get(TOKEN_ENV)
    if env and path is None:
        return check_token(env)
    file = Path(path) if path is not None else default_token_file()
    try:
        dfd = _open_dir(file.parent)
    except (FileNotFoundError, NotADirectoryError):
        raise _no_token() from None
    try:
        _check_token_dir(dfd, file.parent, file)
        found = _read_token_at(dfd, file)
    finally:
        os.close(dfd)
    if found is None:
        raise _no_token()
    return found


def check_token(token: str) -> str:
    """``token`` if it is a str of at least 16 characters, else :class:`ExportConfigError`."""
    if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
        raise E.ExportConfigError(
            f"auth token must be a str of at least {MIN_TOKEN_CHARS} characters, found "
            f"{type(token).__name__} of length {len(token) if isinstance(token, str) else 0}; "
            "leave it unset to have one generated"
        )
    return token


def curve_keys(token: str, role: str) -> tuple[bytes, bytes]:
    """``(public, secret)`` CURVE keys (Z85) of the ``"server"`` (every producer keyed by ``token``) or the
    ``"trainer"``, derived from the token: ``secret = HMAC-SHA256(token, "hs-compat curve <role> v1")``."""
    if role not in ("server", "trainer"):
        raise E.ExportConfigError(f"curve key role must be 'server' or 'trainer', found {role!r}")
    seed = hmac.new(token.encode(), b"hs-compat curve " + role.encode() + b" v1", hashlib.sha256).digest()
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


def server_key(token: str) -> str:
    """The public CURVE key (Z85 text) of producers keyed by ``token``: the ticket's ``server_key``."""
    return curve_keys(check_token(token), "server")[0].decode("ascii")


def plain_key(token: str) -> bytes:
    """The channel's HMAC key: ``HMAC-SHA256(token, "hs-compat plain channel v1")`` (the token itself never
    crosses the connection)."""
    return hmac.new(token.encode(), b"hs-compat plain channel v1", hashlib.sha256).digest()
