"""`memwal serve`: MemWAL tables over Arrow Flight SQL, with every acknowledged write visible to
every client's next query (docs/serving.md).

`memwal_df.serve(tables, ...)` (also `memwal_df.server.serve`) starts a server and returns its
`Server`; `Limits` sets its limits. Modules: `protocol` (Flight SQL messages), `auth` (bearer
tokens), `statements` (SQL text), `queries` (running statements), `ingest` (writes), `catalog`
(metadata commands), `handles`, `limits`, `status` (errors -> Flight status codes), `server` (the
Flight service), `service` (`serve`, `Server`).
"""

from memwal_df.server.limits import Limits
from memwal_df.server.service import Server, serve

__all__ = ["Limits", "Server", "serve"]
