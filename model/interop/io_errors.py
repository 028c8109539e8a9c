"""The operating system's words for a failed write, wherever the library that wrote put them."""

from __future__ import annotations

import errno
import os
import re

# How errno values appear in the messages of the libraries that write checkpoints: TensorStore
# (under orbax) "os_error_code='28'", safetensors (Rust) "(os error 28)".
_CODE = re.compile(r"os_error_code='(\d+)'|\(os error (\d+)\)")


def os_reason(err: BaseException) -> str:
    """"No space left on device, errno ENOSPC" for an OSError or a message that carries an
    errno, else the error's first 200 characters on one line."""
    code = err.errno if isinstance(err, OSError) else None
    match = _CODE.search(str(err))
    if code is None and match:
        code = int(match.group(1) or match.group(2))
    if code is not None:
        return f"{os.strerror(code)}, errno {errno.errorcode.get(code, code)}"
    return " ".join(str(err).split())[:200]
