"""Temporary folders owned by a running process: ``<prefix><pid>-*`` in the temporary folder, holding an
``.owner`` file that its process keeps an ``flock`` on. The kernel lets go of the lock however the process
ends (a SIGKILL, the OOM killer), so the next process that makes one of that prefix removes the folders whose
process died (:func:`owned_folder`): a URL build's staging folder (:mod:`.objects`), the copies a shard task
fetches of remote inputs (:mod:`.remote`)."""
from __future__ import annotations

import glob
import os
import shutil
import tempfile

#: the file in an owned folder that its process holds an ``flock`` on while it runs
OWNER = ".owner"


def _abandoned(folder: str) -> bool:
    """True when no running process holds ``folder``'s owner lock: its process died (the kernel released the
    ``flock``). A folder without an owner file (one being created) is never abandoned."""
    import fcntl

    try:
        fd = os.open(os.path.join(folder, OWNER), os.O_RDONLY)
    except OSError:   # being created, or another user's
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return os.fstat(fd).st_size > 0   # empty: its process has not yet taken the lock it is about to take
    except OSError:
        return False   # held: its process runs
    finally:
        os.close(fd)


def owned_folder(prefix: str, clean: bool = True) -> tuple[str, int]:
    """(a new folder ``<prefix><pid>-*`` in the temporary folder, the descriptor holding its owner lock). First
    (``clean``) the folders of that prefix whose process died are removed: those whose owner ``flock`` no
    process holds (any process on this kernel, whatever its pid namespace: containers sharing ``/tmp`` see each
    other's locks; a pid in the name would not do). The lock goes with the process, however it ends."""
    import fcntl

    if clean:
        for p in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), prefix + "*-*")):
            if _abandoned(p):
                shutil.rmtree(p, ignore_errors=True)
    folder = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    fd = os.open(os.path.join(folder, OWNER), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)   # waits only while a cleaner looks at the new, still empty file
    os.write(fd, f"{os.getpid()}\n".encode())
    return folder, fd
