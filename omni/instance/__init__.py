"""The instance side: what runs inside a model's sandbox (omnid's side is omni/runtime/).

The two sides share one contract module, `settings.py`. From omnid's package the
instance takes only the halves of two shared files meant for it: the code check
(`omni.runtime.code.check_package`) and the GPU yield gate (`omni.runtime.gpuyield`).
"""
