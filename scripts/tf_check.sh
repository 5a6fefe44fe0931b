#!/usr/bin/env bash
# `make tf-check`: terraform fmt, then for each root under infra/terraform/envs/*/* terraform init (without a
# backend), validate, and test where it has *.tftest.hcl files, then checkov. A root whose providers cannot be
# installed here is skipped with the providers named; any other failure fails the run (exit 1).
#
# Providers come from a filesystem mirror when there is one: $TF_PLUGIN_DIR, else the first of /opt/tf-plugins,
# /usr/local/share/terraform/plugins, /usr/share/terraform/plugins, ~/.terraform.d/plugins that holds a
# registry.terraform.io folder; with none, `terraform init` asks the registry. TF_PLUGIN_DIR=registry forces that.
# Working data (.terraform) goes to var/tf-check/<env>-<layer> (TF_DATA_DIR), not into the source tree; a lock file
# that init writes into a root which had none is removed again (one made from a local mirror holds only this
# platform's hashes).
#
#   CHECKOV=.venv-checkov/bin/checkov scripts/tf_check.sh        (CHECKOV=skip: leave checkov out)
set -uo pipefail

cd "$(dirname "$0")/.."
TF_DIR=infra/terraform
WORK=${TF_CHECK_WORK:-var/tf-check}
CHECKOV=${CHECKOV:-.venv-checkov/bin/checkov}
mkdir -p "$WORK"
WORK_ABS=$(cd "$WORK" && pwd)

# A TF_CLI_CONFIG_FILE that names a missing file only makes every command print a warning.
if [ -n "${TF_CLI_CONFIG_FILE:-}" ] && [ ! -e "$TF_CLI_CONFIG_FILE" ]; then
  echo "tf-check: TF_CLI_CONFIG_FILE=$TF_CLI_CONFIG_FILE does not exist; running without it"
  unset TF_CLI_CONFIG_FILE
fi

plugin_dir() {
  if [ -n "${TF_PLUGIN_DIR:-}" ]; then
    [ "$TF_PLUGIN_DIR" != registry ] && echo "$TF_PLUGIN_DIR"
    return 0
  fi
  local d
  for d in /opt/tf-plugins /usr/local/share/terraform/plugins /usr/share/terraform/plugins "$HOME/.terraform.d/plugins"; do
    if [ -d "$d/registry.terraform.io" ]; then
      echo "$d"
      return 0
    fi
  done
}

PLUGIN_DIR=$(plugin_dir)
if [ -n "$PLUGIN_DIR" ] && [ ! -d "$PLUGIN_DIR/registry.terraform.io" ]; then
  echo "tf-check: TF_PLUGIN_DIR=$PLUGIN_DIR holds no registry.terraform.io folder (a provider mirror); fix it or unset it"
  exit 2
fi
if [ -n "$PLUGIN_DIR" ]; then
  echo "tf-check: providers from the mirror $PLUGIN_DIR"
  INIT_ARGS=(-plugin-dir="$PLUGIN_DIR")
else
  echo "tf-check: no provider mirror found (TF_PLUGIN_DIR unset); terraform init uses the registry"
  INIT_ARGS=()
fi

failed=()
summary=()
checked=0
# a lock file init writes into a root that had none is removed again, also when the run is interrupted
new_locks=()
trap 'rm -f "${new_locks[@]}"' EXIT

echo "== terraform fmt -check -recursive $TF_DIR"
if terraform fmt -check -recursive -diff "$TF_DIR"; then
  summary+=("ok       terraform fmt")
else
  failed+=("fmt")
  summary+=("FAILED   terraform fmt")
fi

# check_root DIR: init, validate, test; appends to summary/failed.
check_root() {
  local root=$1 name log had_lock=1
  name=$(echo "${root#"$TF_DIR"/envs/}" | tr / -)
  log="$WORK/$name.log"
  export TF_DATA_DIR="$WORK_ABS/$name"
  [ -e "$root/.terraform.lock.hcl" ] || { had_lock=0; new_locks+=("$root/.terraform.lock.hcl"); }

  echo "== $root: terraform init -backend=false ${INIT_ARGS[*]}"
  if ! terraform -chdir="$root" init -backend=false -input=false -no-color "${INIT_ARGS[@]}" >"$log" 2>&1; then
    # skipped only when every error is a provider this machine cannot install (absent from the mirror, or the
    # registry unreachable); a version constraint no release meets, or anything else, fails
    local flat errors unavailable missing
    flat=$(tr '\n' ' ' <"$log" | tr -s ' ')
    errors=$(grep -o 'Error: ' <<<"$flat" | wc -l)
    unavailable=$(grep -oE 'was not found in any of the search locations|could not connect to registry\.terraform\.io' \
      <<<"$flat" | wc -l)
    missing=$(grep -oE 'available versions for provider [^ :]+' <<<"$flat" | awk '{print $NF}' | sort -u | paste -sd ' ' -)
    if [ "$errors" -gt 0 ] && [ "$errors" = "$unavailable" ] && [ -n "$missing" ]; then
      echo "SKIPPED $root: providers not installable here: $missing"
      summary+=("skipped  $root (providers not installable here: $missing)")
    else
      cat "$log"
      failed+=("$root: init")
      summary+=("FAILED   $root (init)")
    fi
    [ $had_lock = 1 ] || rm -f "$root/.terraform.lock.hcl"
    return
  fi

  local steps="init validate" status=ok
  echo "== $root: terraform validate"
  if ! terraform -chdir="$root" validate -no-color; then
    failed+=("$root: validate")
    status="FAILED (validate)"
  fi
  if compgen -G "$root/*.tftest.hcl" >/dev/null || compgen -G "$root/tests/*.tftest.hcl" >/dev/null; then
    steps="$steps test"
    echo "== $root: terraform test"
    if ! terraform -chdir="$root" test -no-color; then
      failed+=("$root: test")
      status="FAILED (test)"
    fi
  fi
  [ $had_lock = 1 ] || rm -f "$root/.terraform.lock.hcl"
  if [ "$status" = ok ]; then
    checked=$((checked + 1))
    summary+=("ok       $root ($steps)")
  else
    summary+=("$status $root")
  fi
}

for root in "$TF_DIR"/envs/*/*/; do
  root=${root%/}
  compgen -G "$root/*.tf" >/dev/null && check_root "$root"
done
unset TF_DATA_DIR

if [ "$CHECKOV" = skip ]; then
  summary+=("skipped  checkov (CHECKOV=skip)")
else
  echo "== checkov -d $TF_DIR"
  # --skip-download: no guideline look-ups on the network (results are the same). checkov gives up on a file whose
  # HCL takes over 10 s to parse (a loaded machine) and reports it only as a parsing error: allow 120 s, and count
  # any parsing error (a file left unchecked) as a failure.
  export HCL_PARSE_TIMEOUT_SEC=${HCL_PARSE_TIMEOUT_SEC:-120}
  if "$CHECKOV" -d "$TF_DIR" --compact --quiet --skip-download 2>&1 | tee "$WORK/checkov.log"; [ "${PIPESTATUS[0]}" = 0 ] \
    && ! grep -q "Parsing errors: [1-9]" "$WORK/checkov.log"; then
    summary+=("ok       checkov")
  else
    failed+=("checkov")
    summary+=("FAILED   checkov (failed checks or files it could not parse: $WORK/checkov.log)")
  fi
fi

if [ "$checked" = 0 ]; then
  failed+=("no root could be checked")
  summary+=("FAILED   no Terraform root was initialised, validated and tested")
fi

echo "== tf-check summary"
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "tf-check: FAILED: ${failed[*]}"
  exit 1
fi
echo "tf-check: passed"
