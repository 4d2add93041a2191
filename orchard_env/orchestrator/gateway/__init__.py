"""The model gateway: every model call a sandbox's harnesses make, forwarded to the endpoint
chosen for the sandbox with the real key (never in the sandbox), streamed back, recorded.

:mod:`.proxy` serves each sandbox's socket; :mod:`.wire` reads its HTTP; :mod:`.calls` and
:mod:`.assemble` make the record; :mod:`.endpoints` holds the upstreams and their keys;
:mod:`.harness` is what the sandbox is given; :mod:`.readback` reads the records back.
"""
