"""rm: pairwise reward models. Importing any part of it quiets two dependency warnings (rm.quiet)."""

from rm.quiet import install as _install_quiet

_install_quiet()
