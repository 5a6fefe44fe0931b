#!/usr/bin/env bash
# The pipeline image with podman, pulling nothing from a registry (`make image`, `make image-save`).
#
#   infra/image/build.sh build        base from Debian's packages if missing, then the image from the lock; tags
#                                     $IMAGE:latest, $IMAGE:<short rev> and $IMAGE:<flavour> (cuda, or cpu with
#                                     TORCH_INDEX); prints the image id and its size
#   infra/image/build.sh save         $IMAGE:latest as an OCI archive under var/image/ (push it with skopeo copy)
#   infra/image/build.sh run ARGS...  podman run with this machine's settings (containers.conf below)
#   infra/image/build.sh demo         the demo DAG (airflow dags test llm_pipeline, configs/demo.yaml) in a container
#                                     of $IMAGE:latest with no network; prints the registered model and the wall time
#
# Environment: IMAGE (localhost/llm-pipeline), TORCH_INDEX (empty: the lock's CUDA torch), DEBIAN_MIRROR and
# DEBIAN_SECURITY_MIRROR (the base's archives), DEMO_TIMEOUT_S (the demo's bound, default 1800),
# HOST_CA (a CA bundle used for HTTPS during the build only; default: the system bundle when present),
# HOST_WHEELS (a local wheel folder pip may also read during the build, e.g. where a CPU torch wheel lies; with
# TORCH_INDEX set it defaults to PIP_FIND_LINKS when that is one local folder, as the host's pip would read it).
# podman, runc, debootstrap and skopeo are installed from Debian's packages when missing (root or sudo -n).
set -euo pipefail
cd "$(dirname "$0")/../.."

IMAGE=${IMAGE:-localhost/llm-pipeline}
BASE=localhost/debian-base:bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
OUT=var/image
mkdir -p "$OUT"

die() { echo "image: $*" >&2; exit "${2:-1}"; }

ensure_tools() {
  local missing=() t
  for t in podman runc debootstrap skopeo; do command -v "$t" >/dev/null || missing+=("$t"); done
  [ ${#missing[@]} -eq 0 ] && return
  local sudo=
  if [ "$(id -u)" != 0 ]; then sudo -n true 2>/dev/null && sudo=sudo || \
    die "missing tools ${missing[*]}: install them (apt-get install podman runc debootstrap skopeo) and run again" 2; fi
  echo "image: installing ${missing[*]} (apt)"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq podman runc debootstrap skopeo >/dev/null
}

# runc (crun refuses hybrid cgroups on some hosts) and explicit limits no higher than this shell's hard limits
# (podman otherwise asks for more than an unprivileged container host may grant)
write_conf() {
  local nofile nproc
  nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
  [ "$nofile" = unlimited ] && nofile=1048576
  { [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; } && nproc=32768
  cat > "$OUT/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
EOF
  export CONTAINERS_CONF=$PWD/$OUT/containers.conf
}

# Debian bookworm minbase from Debian's packages, with its security and updates suites, imported as $BASE
ensure_base() {
  podman image exists "$BASE" && return
  [ "$(id -u)" = 0 ] || die "building the base needs root (debootstrap): run once as root, or import $BASE" 2
  local root=$OUT/rootfs
  rm -rf "$root"
  trap "rm -rf -- '$root'" EXIT  # a failed or interrupted base build leaves no root file system behind
  echo "image: debootstrap bookworm (minbase) from $DEBIAN_MIRROR"
  debootstrap --variant=minbase bookworm "$root" "$DEBIAN_MIRROR" > "$OUT/debootstrap.log" 2>&1 \
    || { tail -5 "$OUT/debootstrap.log"; die "debootstrap failed (full log: $OUT/debootstrap.log)"; }
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb %s bookworm-security main\n' \
    "$DEBIAN_MIRROR" "$DEBIAN_MIRROR" "$DEBIAN_SECURITY_MIRROR" > "$root/etc/apt/sources.list"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | podman import - "$BASE" >/dev/null
  rm -rf "$root"
  trap - EXIT
}

revision() {
  local rev
  rev=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  # uncommitted or untracked (not ignored) files reach the build context: the revision says so
  [ -n "$(git status --porcelain 2>/dev/null)" ] && rev="$rev-dirty"
  echo "$rev"
}

build() {
  ensure_tools; write_conf; ensure_base
  local rev flavour=cuda args=()
  rev=$(revision)
  [ -n "${TORCH_INDEX:-}" ] && flavour=cpu
  local ca=${HOST_CA-/etc/ssl/certs/ca-certificates.crt}
  [ -n "$ca" ] && [ -s "$ca" ] && args+=(--secret "id=hostca,src=$ca")
  if [ -z "${HOST_WHEELS+set}" ] && [ "$flavour" = cpu ] && [ -d "${PIP_FIND_LINKS:-}" ]; then
    HOST_WHEELS=$PIP_FIND_LINKS
  fi
  if [ -n "${HOST_WHEELS:-}" ]; then
    [ -d "$HOST_WHEELS" ] || die "HOST_WHEELS=$HOST_WHEELS is not a folder" 2
    args+=(--volume "$(realpath "$HOST_WHEELS"):/run/host-wheels:ro" --build-arg HOST_WHEELS=/run/host-wheels)
  fi
  echo "image: building $IMAGE ($flavour torch, revision $rev)"
  local start=$SECONDS lock created
  lock=$(sha256sum requirements.lock | cut -d' ' -f1); created=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  # the changing labels go as --label too: podman 4.3's layer cache ignores build-arg values in a LABEL step, so a
  # commit that changes no copied file would otherwise keep the previous revision's labels
  podman build --pull=never -f infra/image/Containerfile --iidfile "$OUT/iid-$flavour" "${args[@]}" \
    --build-arg TORCH_INDEX="${TORCH_INDEX:-}" --build-arg FLAVOUR="$flavour" --build-arg REVISION="$rev" \
    --build-arg LOCK_SHA256="$lock" --build-arg CREATED="$created" \
    --label org.opencontainers.image.revision="$rev" --label org.opencontainers.image.created="$created" \
    --label io.llm-pipeline.lock.sha256="$lock" --label io.llm-pipeline.torch="$flavour" \
    -t "$IMAGE:latest" -t "$IMAGE:$rev" -t "$IMAGE:$flavour" .
  local size
  size=$(podman image inspect --format '{{.Size}}' "$(cat "$OUT/iid-$flavour")")
  echo "image: $IMAGE:latest = $(cat "$OUT/iid-$flavour") ($flavour, $((size / 1000000)) MB, $((SECONDS - start)) s)"
}

save() {
  write_conf
  podman image exists "$IMAGE:latest" || die "no $IMAGE:latest: run make image first" 2
  local rev flavour file
  rev=$(podman image inspect --format '{{index .Labels "org.opencontainers.image.revision"}}' "$IMAGE:latest")
  flavour=$(podman image inspect --format '{{index .Labels "io.llm-pipeline.torch"}}' "$IMAGE:latest")
  file=$OUT/llm-pipeline-$rev-$flavour.oci.tar
  rm -f "$file.tmp"
  trap "rm -f -- '$file.tmp'" EXIT  # no partial archive after a failure (a full disk) or an interrupt
  podman save --format oci-archive -o "$file.tmp" "$IMAGE:latest"
  mv "$file.tmp" "$file"
  trap - EXIT
  echo "image: $file ($(du -m "$file" | cut -f1) MB)"
  echo "push:  skopeo copy --digestfile var/image/digest oci-archive:$file docker://<registry>/llm-pipeline:$rev-$flavour"
  echo "       then pin <registry>/llm-pipeline@\$(cat var/image/digest) in envs/<env>/platform/terraform.tfvars"
}

# `make demo` inside the image: Airflow's metadata DB, the whole DAG in one `dags test`, then the summary; the
# DAG's log is copied out to var/image/demo-dag.log
demo() {
  write_conf
  podman image exists "$IMAGE:latest" || die "no $IMAGE:latest: run make image first" 2
  local name=llmp-demo-$$ start=$SECONDS rc=0
  # bounded, and the container removed however this ends (a stopped client leaves its container running)
  trap "podman rm -f '$name' >/dev/null 2>&1" EXIT
  timeout "${DEMO_TIMEOUT_S:-1800}" podman run --name "$name" --network none --shm-size 1g "$IMAGE:latest" sh -c '
    airflow db migrate > var/db-migrate.log 2>&1 || { cat var/db-migrate.log; exit 1; }
    airflow dags test llm_pipeline -c "{\"spec\": \"configs/demo.yaml\"}" > var/demo-dag.log 2>&1 || exit 1
    ! grep -q "state=failed" var/demo-dag.log || exit 1
    python -m pipelines.summary --spec configs/demo.yaml' || rc=$?
  podman cp "$name:/opt/llm-pipeline/var/demo-dag.log" "$OUT/demo-dag.log" 2>/dev/null || true
  echo "image demo: rc $rc in $((SECONDS - start)) s (DAG log: $OUT/demo-dag.log)"
  return "$rc"
}

main() {
  case "${1:-}" in
    build) build ;;
    save) save ;;
    run) shift; write_conf; exec podman run "$@" ;;
    demo) demo ;;
    *) die "usage: infra/image/build.sh build|save|run ARGS...|demo" 2 ;;
  esac
}

main "$@"; exit $?  # one line: an edit of this file during a long build cannot run stray text
