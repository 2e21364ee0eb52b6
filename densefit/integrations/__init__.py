"""Integrations with other frameworks; each needs its optional extra (``pip install
'densefit[haystack]'`` for :mod:`densefit.integrations.haystack`)."""
