"""The in-sandbox agent: ``daemon`` (stdlib only), its relocatable bundle, and the client.

The orchestrator reaches each sandbox's agent directly (never through ``docker exec`` or the
Kubernetes exec API): locally on a unix socket in a bind-mounted per-sandbox directory
(``/run/orchard/agent.sock`` inside), on Kubernetes over TCP in the pod.

Agent wire protocol (HTTP/1.1, keep-alive; request bodies with Content-Length or chunked):

Auth (:mod:`orchard_env.agent.daemon.proof`)
    The agent starts with no key. The orchestrator's first request, ``POST /enroll {key,
    env}``, gives it the sandbox's key and the environment its commands get (409 once
    enrolled); no command can run before it. Every other request (and ``GET /health`` when it
    carries one) has ``X-Orchard-Nonce``, ``X-Orchard-Body-Sha256`` and ``Authorization:
    Orchard-HMAC <mac>`` over them, the method and the target (otherwise 401); every answer to
    it carries ``X-Orchard-Proof``, and a job stream ends with a ``{"t": "p", "mac"}`` line.
    The client treats an answer without a valid proof as tampering.

Errors
    JSON ``{"code", "message"}`` with the status of the code: ``invalid_request`` 400,
    ``unauthenticated`` 401, ``file_not_found``/``job_not_found``/``not_found`` 404,
    ``conflict`` 409, ``internal`` 500. The client raises the :mod:`orchard_env.errors` class
    registered for the code.

Routes
    ``GET /health`` -> ``{"status": "ok", "pid", "version", "enrolled"}``

    ``POST /exec`` ``{job_id, command, cwd?, env?, timeout?, login_shell?, stdin?,
    max_output_bytes?}`` -> 200 ``application/x-ndjson``, chunked, one event per line while
    the command runs:

    * ``{"t": "o", "d": <base64 stdout chunk>}`` / ``{"t": "e", "d": <base64 stderr chunk>}``
    * then ``{"t": "x", "exit_code": int|null, "signal": int|null, "timed_out": bool,
      "cancelled": bool, "oom_killed": bool, "truncated": bool, "dropped": [int, int],
      "error": str|null, "duration": float}``
    * last: ``{"t": "p", "mac"}``, the proof over every byte of the stream before it

    A string ``command`` runs as ``/bin/bash -c`` (``/bin/sh -c`` without bash), a list as an
    argv; ``login_shell`` uses an interactive login bash that sources ``~/.bashrc``
    (``sh -l -c`` without bash). Each command gets
    its own session and is a child subreaper; a timeout or cancel SIGKILLs its whole tree
    (``setsid``/``nohup`` descendants and orphans included), nothing else. Past half of
    ``max_output_bytes`` a stream's output goes to a ring of the other half, sent after the
    command ended; ``dropped`` counts the bytes between head and tail (``truncated``).
    ``oom_killed``: the command ended by a SIGKILL (or exit 137) the agent did not send while
    the sandbox's memory cgroup counted an OOM kill (``oom_kill`` in cgroup v2's
    ``memory.events``, v1's ``memory.oom_control``). A
    missing ``cwd`` is a 400; a missing binary ends with exit code 127 and ``error`` naming
    it. The agent environment (with the enrolled ``env``) reaches the command without the
    agent's own variables, plus the request's ``env``.

    Idempotency: a ``job_id`` the agent knows (running, or finished within the last hour) is
    never run again: the same request attaches, replaying the output from the start, then
    live output, then the exit event (409 ``conflict`` if the command differs).

    ``GET /exec/{job_id}`` attaches (same stream); ``POST /exec/{job_id}/cancel`` ->
    ``{"job_id", "cancelled": bool}`` (false when it had already finished, or exited by
    itself). A job id not known yet is remembered (the last 1024): its exec, arriving after
    the cancel, ends ``cancelled`` (``error`` "cancelled before it started") without running.

    ``GET /files?path=`` raw bytes (404 missing, 400 directory); ``PUT /files?path=&mode=0644``
    raw body, written to a temporary file beside the target and renamed (parents created) ->
    ``{"path", "size"}``; ``GET /files/list?path=`` -> ``[{name, type: file|directory|
    symlink|other, size, modified (ISO 8601 UTC)}]`` sorted, from ``lstat``;
    ``DELETE /files?path=&recursive=false`` -> ``{"deleted"}`` (409 for a non-empty directory
    without ``recursive``); ``POST /files/mkdir?path=&parents=true`` -> ``{"path"}``.
    Relative paths resolve against the sandbox workdir (``ORCHARD_AGENT_WORKDIR``).

    ``GET /pty`` WebSocket (text frames, upstream's JSON protocol): the client sends
    ``{"type": "init", "cmd", "env", "cwd", "rows", "cols", "login_shell"}`` within 10 s
    (else close 4400), then ``stdin{data}``, ``signal{sig: TERM|KILL|INT|HUP|QUIT}``,
    ``resize{rows, cols}``, ``close``; the agent sends ``ready{pid}``, ``stdout{data}``
    (base64, up to 64 KiB raw per frame), ``exit{code}`` (negative: killed by that signal),
    ``error{message}`` (a failed spawn closes with 4500). Signals go to the session's process
    group; ``KILL``, the end of the 5 s grace after ``close`` (which sends ``TERM``) and a
    disconnect kill its whole tree instead, ``setsid``/``nohup`` descendants included (the
    command is a child subreaper, as a job's is).

    ``POST /model/relay`` (a sandbox whose model calls are relayed over parked connections,
    see :mod:`orchard_env.agent.daemon.model`) -> ``101`` ``Upgrade: orchard-model-relay``,
    proven over ``upgrade``; the connection then waits for a harness connection to
    ``127.0.0.1:4000``, announced by one ``+`` byte, after which it carries that
    connection's bytes both ways (409 for a sandbox without such a relay).
"""
