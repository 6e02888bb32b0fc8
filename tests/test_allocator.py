"""The commands' host-allocator setting (glibc): a freed 4 MiB buffer stays in the heap for the
next step instead of going back to the kernel; a user's own MALLOC_* settings are kept."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt (Linux)")

# Prints whether the setting applied, then how many blocks glibc maps on their own while a
# 4 MiB buffer is held (beyond those mapped once it is freed), before and after the setting.
_SCRIPT = """
import ctypes
from posenc_jax import allocator

class Info(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
              "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]

def mapped_while_held():
  block = libc.malloc(4 << 20)
  held = libc.mallinfo2().hblks
  libc.free(block)
  return held - libc.mallinfo2().hblks

before = mapped_while_held()
print(allocator.keep_freed_buffers(), before, mapped_while_held())
"""


def _run(env):
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return proc.stdout.split()


def test_a_freed_buffer_stays_in_the_heap():
  env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
  assert _run(env) == ["True", "1", "0"]


def test_the_users_own_settings_are_kept():
  env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
  assert _run(env | {"MALLOC_TRIM_THRESHOLD_": "0"}) == ["False", "1", "1"]
