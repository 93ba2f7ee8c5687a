"""Test session setup: two host CPU devices, for the partitioning tests."""

import os

# Must precede the first `import jax` of the session.
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=2').strip()
