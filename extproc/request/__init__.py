"""request: one HTTP request's life in kvgate, one module per stage.

``profile``: the Envoy files, one row each, and the ``ReleaseMode`` a request admitted through
each takes; ``admit``: the decision on a whole body (count, acquire, answer: ``Refused`` or
``Admitted``); ``refusals``: the answers that end a request before admission; ``ending``: one
kind of ending per way an admitted request ends, holding its lease until it releases it once;
``causes``: the cause and charge table the endings apply; ``registry``: the endings whose end
comes from elsewhere than their own stream (observed, parked, awaiting their cause);
``accesslog``: Envoy's access log, read entry by entry for the registry; ``arrival``: a request
identified and its body collected, then handed to ``admit``. A stream is in one stage at a
time, its arrival's and then, once admitted, its ending's (``extproc.service.answer``).
"""
