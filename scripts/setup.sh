#!/usr/bin/env bash
# One-time (and idempotent) set-up of everything sglang-pdd needs on a fresh CPU machine:
#   Debian libs for Mooncake, a venv (.venv) with real SGLang 0.5.23 (CPU "light" install),
#   the patches in patches/, the CPU stand-in for sgl_kernel, this package (editable, which
#   registers the SGLang plugin entry point), and a tiny locally built model.
# Usage: scripts/setup.sh            # set up (fast no-op when already done)
#        scripts/setup.sh --check    # only verify that every patch in patches/ applies / is applied
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${PDD_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
MODEL_DIR="${PDD_MODEL_DIR:-$ROOT/artifacts/tiny-llama}"
MLA_MODEL_DIR="${PDD_MLA_MODEL_DIR:-$ROOT/artifacts/tiny-deepseek}"
SWA_MODEL_DIR="${PDD_SWA_MODEL_DIR:-$ROOT/artifacts/tiny-mellum}"
STAMP="$VENV/.pdd-setup-stamp"
log() { echo "[setup] $*"; }

# pip, quietly: this machine kind's pip config adds index locations that print a warning each.
pip_install() { "$PY" -m pip install -q "$@" 2> >(grep -v "^WARNING: Location .* is ignored" >&2); }

site_packages() { "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# Each patch is a -p1 diff against site-packages. Applied ones are detected by a reverse dry-run.
apply_patches() {
  local mode="$1" sp; sp="$(site_packages)"
  local failed=0
  for p in "$ROOT"/patches/*.patch; do
    local name; name="$(basename "$p")"
    if patch -p1 -d "$sp" --dry-run -R -s -f < "$p" >/dev/null 2>&1; then
      log "patch $name: applied"
    elif patch -p1 -d "$sp" --dry-run -s -f < "$p" >/dev/null 2>&1; then
      if [ "$mode" = check ]; then log "patch $name: applies cleanly (not yet applied)"
      else patch -p1 -d "$sp" -s -f --no-backup-if-mismatch < "$p"; log "patch $name: applied now"; fi
    else
      log "patch $name: DOES NOT APPLY to $sp"; failed=1
    fi
  done
  return $failed
}

if [ "${1:-}" = "--check" ]; then
  [ -x "$PY" ] || { log "no venv at $VENV; run scripts/setup.sh first"; exit 1; }
  apply_patches check; exit $?
fi

# 1. Debian packages: Mooncake's engine.so links libibverbs even when it only speaks TCP; the TLS
#    tests make their certificates with openssl.
missing=()
for pkg in libibverbs1 librdmacm1 libnuma1 patch openssl; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
# kubectl renders deploy/kubernetes (tests/unit/deploy skip without it): Debian's own package where
# apt has one (the kubernetes-client of Debian 12 is 1.20, too old for kustomize v5's fields).
if ! command -v kubectl >/dev/null 2>&1 && apt-cache policy kubectl 2>/dev/null | grep -q "Candidate: [0-9]"; then
  missing+=(kubectl)
fi
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# 2. The venv with SGLang. Skipped when the stamp matches the requirement files (their
# comments and blank lines left out: editing a comment installs nothing).
want_stamp="$(cat "$ROOT/scripts/requirements-sglang-cpu.txt" "$ROOT/scripts/constraints.txt" "$ROOT/pyproject.toml" \
  | sed -e 's/[[:space:]]*#.*$//' -e '/^[[:space:]]*$/d' | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want_stamp" ]; then
  [ -x "$PY" ] || python3 -m venv "$VENV"
  log "installing torch (CPU) and sglang 0.5.23 (light install) into $VENV; ~5 min on a fresh machine"
  pip_install --upgrade pip
  # On this machine kind torch==2.13.0 resolves to the CPU wheel kept on local disk.
  pip_install -c "$ROOT/scripts/constraints.txt" torch==2.13.0
  pip_install --no-deps sglang==0.5.23
  # sglang's own pins (CUDA torch, sglang-kernel, ...) are deliberately not met: pip reports
  # them as conflicts below; the light CPU set is what was verified to run.
  pip_install -c "$ROOT/scripts/constraints.txt" -r "$ROOT/scripts/requirements-sglang-cpu.txt"
  pip_install --no-deps -e "$ROOT"
  echo "$want_stamp" > "$STAMP"
else
  log "venv up to date ($VENV)"
fi

# 3. CPU stand-in for sgl_kernel, visible to every process of the venv (servers are subprocesses).
echo "$ROOT/cpu_shims" > "$(site_packages)/sglang_pdd_cpu_shims.pth"

# 4. Small upstreamable diffs SGLang (and a CPU-only torchvision) need; see patches/README.md.
apply_patches apply

# 5. Tiny models + tokenizer, built locally (deterministic, no downloads): a Llama (MHA KV pool),
#    a DeepSeek-V2-style model (MLA KV pool) for tests/e2e/test_e2e_mla.py, and a Mellum-style
#    hybrid sliding-window model (SWAKVPool) for tests/e2e/test_e2e_swa.py.
"$PY" "$ROOT/scripts/build_tiny_model.py" --out "$MODEL_DIR"
"$PY" "$ROOT/scripts/build_tiny_model.py" --arch deepseek_v2 --out "$MLA_MODEL_DIR"
"$PY" "$ROOT/scripts/build_tiny_model.py" --arch mellum --out "$SWA_MODEL_DIR"

"$PY" -c "import sglang, sglang_pdd, sgl_kernel, mooncake.engine; print('[setup] ok: sglang', sglang.__version__)"
