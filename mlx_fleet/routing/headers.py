"""The HTTP header names of the fleet's OpenAI API, one definition each: sent by clients, by a
forwarding agent (and the fleet router to come), and answered by every agent.

Pure: constants only.
"""

from __future__ import annotations

__all__ = ["REVISION_HEADER", "SESSION_HEADER", "PIN_HEADER"]

#: Response header naming the revision that served the request.
REVISION_HEADER = "X-Model-Revision"
#: Request header carrying the session key of the canary split (else the ``user`` field;
#: :func:`mlx_fleet.routing.session.session_key`).
SESSION_HEADER = "X-Session-ID"
#: Request header a forwarding agent sets: serve exactly this revision, don't split again.
#: Honoured only from the fleet-internal credential (or when the API has no keys at all);
#: a client key presenting it has it ignored (routed as if it were absent).
PIN_HEADER = "X-MLX-Fleet-Revision"
