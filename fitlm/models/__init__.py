"""Model families and their weight formats; import from the modules (fitlm.models.io, fitlm.models.hf, ...).

This file imports nothing, nor does any family folder's `__init__.py`: importing a family's torch-free
`spec` module (what validating a config reads) then runs no model code. The registry imports each
folder's `family.py`, which registers its torch `Family`, on the first family lookup.
"""
