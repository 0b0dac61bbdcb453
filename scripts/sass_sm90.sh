#!/usr/bin/env bash
# SASS of one CUDA translation unit for sm_90a, on a machine without a GPU: a developer's aid for
# register and instruction-mix experiments (kernels/mla/NOTES.md, session 21). Not used by the
# build or the tests.
#
#   scripts/sass_sm90.sh FILE.cu OUT_PREFIX [extra nvcc flags]
#
# Writes OUT_PREFIX.cubin, OUT_PREFIX.ptxas (registers, spills) and OUT_PREFIX.sass, and prints
# the kernels' register counts. Compiled with the flags of the project's CUDA kernels.
#
# The disassembler: $NVDISASM, else `nvdisasm` on PATH. CUDA 13's toolkit here ships none;
# CUDA 11.8's reads SM90 code once the cubin's ELF header is rewritten from the ABI-8 form nvcc 13
# writes to the ABI-7 form it knows (EI_ABIVERSION 7; e_flags = virtual SM << 16 | 0x500 | SM);
# the instruction encoding is the same, so the listing is exact. Debian 12 has it in the non-free
# component (package nvidia-cuda-toolkit 11.8); to get the binary without installing anything:
#   apt-get download nvidia-cuda-toolkit   # with "non-free" in the apt sources' Components
#   dpkg -x nvidia-cuda-toolkit_*.deb /tmp/cuda118 && export NVDISASM=/tmp/cuda118/usr/bin/nvdisasm
set -euo pipefail
src=${1:?usage: scripts/sass_sm90.sh FILE.cu OUT_PREFIX [nvcc flags]}
out=${2:?usage: scripts/sass_sm90.sh FILE.cu OUT_PREFIX [nvcc flags]}
shift 2
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}
nvdisasm=${NVDISASM:-$(command -v nvdisasm || true)}
[[ -n "$nvdisasm" ]] || { echo "no nvdisasm: set NVDISASM (see this script's head)" >&2; exit 2; }
"$nvcc" -std=c++17 -O3 -DNDEBUG -arch=sm_90a -cubin -I"$root" --use_fast_math \
  --expt-relaxed-constexpr -lineinfo -Xptxas -v "$@" -o "$out.cubin" "$src" 2>"$out.ptxas"
if ! "$nvdisasm" -c "$out.cubin" >"$out.sass" 2>/dev/null; then
  # An older nvdisasm: the same cubin with the ABI-7 header.
  python3 - "$out.cubin" "$out.abi7.cubin" <<'PY'
import struct, sys
d = bytearray(open(sys.argv[1], "rb").read())
assert d[:4] == b"\x7fELF" and d[4] == 2, "not a 64-bit ELF"
sm = (struct.unpack_from("<I", d, 48)[0] >> 8) & 0xff  # ABI 8: the SM in bits 8..15
d[8] = 7
struct.pack_into("<I", d, 48, (sm << 16) | 0x500 | sm)
open(sys.argv[2], "wb").write(d)
PY
  "$nvdisasm" -c "$out.abi7.cubin" >"$out.sass"
fi
grep -E "Function properties for|registers|spill" "$out.ptxas" | sed -E 's/ptxas info *: //'
echo "SASS: $out.sass ($(grep -cE '^\s+/\*[0-9a-f]{4}\*/' "$out.sass") instructions)"
