"""The DSP backend conformance kit: pytest tests any installed backend must pass.

    pytest --pyargs dsp_core.testing.conformance --dsp-backend NAME [--dsp-seed N]

The pytest plugin (``plugin.py``, entry point ``pytest11: dsp_conformance``) adds the
options and the ``dsp_backend`` fixture; without ``--dsp-backend`` every kit test skips.
The tests: op cases against the SLOT_BY_SLOT reference on fresh random inputs
(``test_kit_ops``), the plan lifecycle, variable drift and clean release
(``test_kit_lifecycle``), and the truth of the backend's ModeContract
(``test_kit_contract``). docs/conformance.md says what each checks.
"""
