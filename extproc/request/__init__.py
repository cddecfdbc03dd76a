"""request: one HTTP request's life in kvgate, from the Envoy file it comes through
(``profile``) to the cause it ends with (``causes``)."""
