"""The default filter of Lance's native log, installed before memwal_df first imports `lance`.

Lance reads `LANCE_LOG` once, when its native module loads, and logs `ERROR lance::index] Index
__lance_mem_wal has no fields` whenever it looks for a scalar index on a table that has a MemWAL
index (every MemWAL table has one): a merge into a table whose primary key has a scalar index does.
The message is harmless. When the process has not set `LANCE_LOG`, memwal_df sets it to Lance's own
default level plus an `off` directive for the `lance::index` module alone (its sub-modules keep
`warn`). A `LANCE_LOG` the user set is left as it is; so is the filter of a process that imported
`lance` before memwal_df (Lance has read the variable by then).
"""

from __future__ import annotations

import os
import sys

ENV = "LANCE_LOG"
DEFAULT = "warn,lance::index=off,lance::index::=warn"


def install_default() -> bool:
    """Set `LANCE_LOG` to `DEFAULT` if it is unset and Lance is not loaded yet; True if it was set."""
    if ENV in os.environ or "lance" in sys.modules:
        return False
    os.environ[ENV] = DEFAULT
    return True


install_default()
