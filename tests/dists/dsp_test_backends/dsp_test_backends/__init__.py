"""Backends used by DSP's own tests; inert unless DSP_TEST_BACKENDS=1."""
