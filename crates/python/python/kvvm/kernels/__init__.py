"""Attention kernels over kvvm's full-length K/V, each request's token range read on the device:
:mod:`kvvm.kernels.attend` (the choice of kernel, :func:`~kvvm.kernels.attend.attend`, and the
``kvvm::write_attend`` operator the cache's attention runs) and
:mod:`kvvm.kernels.triton_decode` (the split-KV decode kernel in Triton; when its autotuner
may measure: :mod:`kvvm.kernels.tuning`). Pure Python over
torch (and triton, imported when its kernel runs); no native part. Importing the package
imports neither.
"""
