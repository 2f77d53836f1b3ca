"""Every file and directory of a store is made and reached here: private to its owner
(directories 0700, files 0600) unless the store is shared (group access: directories
2770, files 0660), and reached from the store's root one component at a time, never
through a link below the root (the root itself may be a link).

    private_dir(root, "blobs/ab", shared=False)            # made as needed, with its mode
    write_file_atomic(root, "names/value/abc", [data], shared=False)
    with open_below(root, "names/value/abc") as f: raw = f.read()
    remove_below(root, "blobs/ab/abcd.safetensors")
    for rel, st in files_below(root, "names"): ...          # regular files only

A link anywhere below the root (a symlinked ``blobs/ab``, ``names/artifact`` or name
file) raises ``BelowLink`` (an ``OSError``, errno ELOOP) naming it: nothing outside the
store is read, written or removed through it. Each component is opened with
``O_NOFOLLOW`` relative to the directory before it (``openat``), so a link swapped in
between a check and a use is refused too.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Callable, Iterator, Sequence

DIR_MODE = {False: 0o700, True: 0o2770}  # setgid: files made in a shared store keep its group
FILE_MODE = {False: 0o600, True: 0o660}
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class BelowLink(OSError):
    """A path below a store's root is a link (or not what it must be): refused."""


def _parts(relpath: str) -> list[str]:
    parts = relpath.split("/") if relpath else []
    for p in parts:
        if p in ("", ".", "..") or "\0" in p:
            raise ValueError(f"{relpath!r} is not a plain path below a store's root")
    return parts


def _refused(root: str, rel: str, what: str) -> BelowLink:
    return BelowLink(errno.ELOOP,
                     f"{os.path.join(root, rel)} is {what}; a store never follows a link "
                     f"below its root: remove it (or point the store at the real directory)")


def _open_dir(root: str, parts: Sequence[str], make: bool, shared: bool) -> int:
    """A descriptor of the directory ``root/parts...``, made (with the store's mode) when
    ``make``; BelowLink where a component is a link or not a directory."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root may be a link
    try:
        for i, p in enumerate(parts):
            try:
                nfd = os.open(p, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not make:
                    raise
                try:
                    os.mkdir(p, DIR_MODE[shared], dir_fd=fd)
                    made = True
                except FileExistsError:
                    made = False  # made by another writer meanwhile
                nfd = _open_dir_at(fd, root, parts[: i + 1])
                if made:
                    os.fchmod(nfd, DIR_MODE[shared])  # exact, whatever the umask
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _link_or_file(fd, root, parts[: i + 1]) from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir_at(fd: int, root: str, parts: Sequence[str]) -> int:
    try:
        return os.open(parts[-1], _DIR_FLAGS, dir_fd=fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _link_or_file(fd, root, parts) from None
        raise


def _link_or_file(fd: int, root: str, parts: Sequence[str]) -> BelowLink:
    rel = "/".join(parts)
    try:
        st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        what = "a link" if stat.S_ISLNK(st.st_mode) else "not a directory"
    except OSError:
        what = "not a directory"
    return _refused(root, rel, what)


def private_dir(root: str | os.PathLike, reldir: str = "", shared: bool = False) -> None:
    """Make ``root`` (if missing) and ``root/reldir`` with the store's mode. An existing
    directory owned by this user loses what others may do, and what its group may do
    unless it is a shared store's (setgid and group-writable: left so, since its group
    uses it); ``shared`` gives it its group's access. The root's own mode is left as its
    owner made it."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        os.makedirs(root, DIR_MODE[shared], exist_ok=True)
        os.chmod(root, DIR_MODE[shared])
    parts = _parts(reldir)
    fd = _open_dir(root, parts, make=True, shared=shared)
    try:
        if parts:
            _narrow(fd, shared)
    finally:
        os.close(fd)


def _narrow(fd: int, shared: bool) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        return  # not ours to change
    mode = stat.S_IMODE(st.st_mode) & ~0o007
    if shared:
        mode |= 0o2070
    elif mode & 0o2020 != 0o2020:  # not a shared store's (setgid, group-writable) either
        mode &= ~0o070
    if mode != stat.S_IMODE(st.st_mode):
        os.fchmod(fd, mode)


def _open_file(root: str, dirs: Sequence[str], relpath: str, flags: int, make: bool,
               shared: bool) -> int:
    """A descriptor of ``root/relpath``, the file last in it opened with ``flags`` in
    the directory ``dirs`` (walked without following a link); BelowLink where it is one."""
    dfd = _open_dir(root, dirs, make=make, shared=shared)
    try:
        return os.open(_parts(relpath)[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC,
                       FILE_MODE[shared], dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refused(root, relpath, "a link") from None
        raise
    finally:
        os.close(dfd)


def open_below(root: str | os.PathLike, relpath: str):
    """The file ``root/relpath`` opened for reading (binary); BelowLink where any
    component below the root is a link, FileNotFoundError where it is missing."""
    root = os.fspath(root)
    parts = _parts(relpath)
    fd = _open_file(root, parts[:-1], relpath, os.O_RDONLY, make=False, shared=False)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refused(root, relpath, "not a regular file")
    return os.fdopen(fd, "rb")


def open_lock(root: str | os.PathLike, name: str, shared: bool) -> int:
    """A descriptor of the file ``root/name`` (made, with the store's mode) to lock."""
    root = os.fspath(root)
    fd = _open_file(root, [], name, os.O_RDWR | os.O_CREAT, make=False, shared=shared)
    if shared:
        _share_file(fd)
    return fd


def _share_file(fd: int) -> None:
    st = os.fstat(fd)
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != FILE_MODE[True]:
        os.fchmod(fd, FILE_MODE[True])


def write_file_atomic(root: str | os.PathLike, relpath: str, pieces: Sequence,
                      shared: bool = False, fsync: bool = False,
                      step: Callable[[str], None] | None = None) -> None:
    """Write ``pieces`` (bytes-like, in order) to ``root/relpath``: whole into
    ``root/tmp/`` first (mode 0600, or 0660 shared), then renamed into place, its
    directories made as needed. ``step`` is called at each step ("open", "partial",
    "written", "closed", "renamed"; tests stop a writer there)."""
    root = os.fspath(root)
    parts = _parts(relpath)
    step = step or (lambda what: None)
    tmp_fd = _open_dir(root, ["tmp"], make=True, shared=shared)
    tmp = f"{os.getpid()}-{uuid.uuid4().hex}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     FILE_MODE[shared], dir_fd=tmp_fd)
        try:
            if shared:
                os.fchmod(fd, FILE_MODE[True])  # exact, whatever the umask
            with os.fdopen(fd, "wb") as f:
                step("open")
                for i, p in enumerate(pieces):
                    f.write(p)
                    if i == 0:
                        f.flush()
                        step("partial")
                f.flush()
                step("written")
                if fsync:
                    os.fsync(f.fileno())
            dst_fd = _open_dir(root, parts[:-1], make=True, shared=shared)
            try:
                step("closed")
                # atomic; a link already at the final name is replaced, never followed
                os.rename(tmp, parts[-1], src_dir_fd=tmp_fd, dst_dir_fd=dst_fd)
                step("renamed")
                if fsync:
                    os.fsync(dst_fd)
            finally:
                os.close(dst_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=tmp_fd)
            except FileNotFoundError:
                pass
            raise
    finally:
        os.close(tmp_fd)


def remove_below(root: str | os.PathLike, relpath: str) -> bool:
    """Remove the file (or link: never what it points at) ``root/relpath``; False when
    it was not there."""
    root = os.fspath(root)
    parts = _parts(relpath)
    try:
        dfd = _open_dir(root, parts[:-1], make=False, shared=False)
    except FileNotFoundError:
        return False
    try:
        os.unlink(parts[-1], dir_fd=dfd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(dfd)


def move_below(root: str | os.PathLike, src: str, dst: str, shared: bool = False) -> None:
    """Rename ``root/src`` to ``root/dst`` (the directory of ``dst`` made as needed)."""
    root = os.fspath(root)
    sp, dp = _parts(src), _parts(dst)
    sfd = _open_dir(root, sp[:-1], make=False, shared=shared)
    try:
        dfd = _open_dir(root, dp[:-1], make=True, shared=shared)
        try:
            os.rename(sp[-1], dp[-1], src_dir_fd=sfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def files_below(root: str | os.PathLike, reldir: str,
                on_link: Callable[[str], None] | None = None
                ) -> Iterator[tuple[str, os.stat_result]]:
    """Every regular file under ``root/reldir`` (sorted, depth first), as its path
    relative to ``reldir`` and its ``lstat``. Links are never entered nor yielded;
    ``on_link(path relative to the root)`` hears of each. Nothing when ``reldir`` is missing."""
    root = os.fspath(root)
    try:
        fd = _open_dir(root, _parts(reldir), make=False, shared=False)
    except FileNotFoundError:
        return
    heard = None if on_link is None else (lambda rel: on_link(f"{reldir}/{rel}"))
    try:
        yield from _walk(fd, "", heard)
    finally:
        os.close(fd)


def _walk(fd: int, prefix: str, on_link) -> Iterator[tuple[str, os.stat_result]]:
    for name in sorted(os.listdir(fd)):
        rel = prefix + name
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed meanwhile
        if stat.S_ISREG(st.st_mode):
            yield rel, st
        elif stat.S_ISDIR(st.st_mode):
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                continue  # removed, or swapped for a link, meanwhile
            try:
                yield from _walk(sub, rel + "/", on_link)
            finally:
                os.close(sub)
        elif on_link is not None and stat.S_ISLNK(st.st_mode):
            on_link(rel)
