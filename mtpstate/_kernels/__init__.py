"""numba kernels, private, one module per phase of a step.

Data flow: ``native`` (loads, stores and CPython C-API calls as numba
intrinsics) -> ``index`` (the request id -> row hash index) -> ``step``
(finish, add, update of one scheduler step) -> ``arrays`` (the array entry
point). The Python API (``mtpstate.index``, ``mtpstate.table``) launches them
with integer arguments only.
"""
