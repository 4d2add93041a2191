"""Orchard's in-sandbox agent: a small HTTP/1.1 + WebSocket server, Python standard library only.

It runs under the relocatable bundle interpreter inside any image (see ``orchard_env.agent``
for the wire protocol), so it imports nothing outside the standard library, starts fast and
stays small (idle PSS target: 15 MB; what only a command, a file spill or a terminal needs
is imported when first needed). The bundle ships this package as ``orchard_agent``
(bytecode only) beside an entry ``__main__``; on the host it runs as::

    python -I -m orchard_env.agent.daemon --listen unix:/run/orchard/agent.sock
    python -I -m orchard_env.agent.daemon --listen tcp:0.0.0.0:9090

It takes the sandbox's key (and the sandbox's environment for commands) from the
orchestrator's ``POST /enroll``, never from its environment, and makes itself non-dumpable
(:mod:`.proof`, :func:`.server.become_undumpable`).
``ORCHARD_AGENT_WORKDIR`` (default ``/workspace``) is where relative paths and commands start;
``ORCHARD_AGENT_SUBREAPER`` names the bundle's ``orchard-subreaper``, which starts each command
(without it, as when run from source, a command is made a subreaper in CPython's forked child).

Threads, not asyncio (whose import costs every sandbox's start): the main thread runs the
loop that owns the jobs and the children, each connection has a thread of its own.

Modules: :mod:`.init` (PID 1's reaper), :mod:`.loop` (the event loop), :mod:`.http`
(connections, requests, responses, errors), :mod:`.procs` (how commands are started and
reaped),
:mod:`.jobs` (exec jobs and their output), :mod:`.files` (the file routes),
:mod:`.websocket` and :mod:`.pty` (terminals), :mod:`.proof` (the MACs of requests and
answers), :mod:`.server` (routes, enrollment, auth, entry).
"""
