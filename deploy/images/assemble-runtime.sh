#!/usr/bin/env bash
# Assembles the runtime tree the accrue images ship, into OUT:
#
#   OUT/usr/local/bin/<binary>     the binaries given, with their RPATH set
#                                  to $ORIGIN/../lib/accrue (DT_RPATH, which
#                                  also serves libraries without a path of
#                                  their own)
#   OUT/usr/local/lib/accrue/      every non-system shared library they load:
#                                  libtorch_cpu, libc10, libgomp, libcudart,
#                                  ... and for CUDA builds libtorch_cuda,
#                                  cuDNN, cuBLAS, NCCL, NVRTC, ...
#   OUT/usr/lib/<multiarch>/       the system libraries they load (glibc,
#                                  libstdc++, libgcc_s) and the loader, taken
#                                  from the build machine
#   OUT/lib -> usr/lib, OUT/lib64 -> usr/lib64 (merged /usr, as Debian), so
#                                  the loader is where the binaries name it
#   OUT/etc/passwd, group, nsswitch.conf; OUT/tmp (1777); OUT/home/nonroot:
#                                  user and group nonroot, 65532
#
# The tree is self-contained (its own glibc and loader): it runs on an empty
# base (FROM scratch), and a test starts the binaries from it with nothing
# but its own libraries (tests/images/).
#
# Libraries are found as the loader finds them (as ldd does),
# libtorch's own dependencies included. CUDA builds (a binary loading
# libtorch_cuda.so, or --cuda) also get what libtorch and CUDA open later with
# dlopen (cuDNN's engines, NVRTC, the lazily loaded linalg library, ...):
# every shared library in libtorch's lib/ folder and in the nvidia/*/lib
# folders its RPATH names, except Python-only ones and optional plugins whose
# own dependencies (MPI, UCX, InfiniBand, ...) the build machine lacks. The
# driver (libcuda.so.1, libnvidia-ml.so.1) is never shipped: the NVIDIA
# container toolkit mounts the host's.
#
# Usage: assemble-runtime.sh [--cuda] [--link] [--strip] OUT BIN...
#   --cuda   ship the CUDA libraries (automatic when a binary loads
#            libtorch_cuda.so)
#   --link   hard-link libraries instead of copying them where the file
#            system allows (tests). Binaries, and libraries whose RPATH is
#            rewritten, are always copied: nothing is modified in place.
#   --strip  strip debug information from the binaries (debug builds)
# OUT must not exist or be empty. Last, the script starts the tree's own
# loader on every binary with only the tree's libraries and fails if anything
# is missing or resolves outside OUT.
set -euo pipefail

prog=${0##*/}
die() {
  echo "$prog: $*" >&2
  exit 1
}
note() { echo "$prog: $*" >&2; }
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

cuda=auto link=0 strip=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --cuda) cuda=1 ;;
    --link) link=1 ;;
    --strip) strip=1 ;;
    -h | --help)
      usage
      exit 0
      ;;
    --)
      shift
      break
      ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) break ;;
  esac
  shift
done
[[ $# -ge 2 ]] || die "usage: $prog [--cuda] [--link] [--strip] OUT BIN..."
out=$1
shift
bins=("$@")

for tool in patchelf readelf realpath cmp; do
  command -v "$tool" >/dev/null || die "$tool is required (Debian: patchelf, binutils, coreutils, diffutils)"
done
[[ $strip == 0 ]] || command -v strip >/dev/null || die "--strip needs strip (binutils)"
declare -A seen_bin=()
for b in "${bins[@]}"; do
  [[ -f $b && -x $b ]] || die "$b: not an executable file"
  [[ -z ${seen_bin[${b##*/}]:-} ]] || die "two binaries are named ${b##*/}"
  seen_bin[${b##*/}]=1
done
if [[ -e $out ]]; then
  [[ -d $out && -z $(ls -A "$out") ]] || die "$out exists and is not an empty folder"
fi
mkdir -p "$out"
out=$(realpath "$out")

# ELF facts through readelf, which reads only the headers (patchelf reads
# the whole file: seconds for libtorch).
interpreter_of() {
  readelf -lW "$1" | sed -n 's/.*Requesting program interpreter: \(.*\)]$/\1/p'
}
rpath_of() { # DT_RPATH or DT_RUNPATH, empty when none
  readelf -dW "$1" | sed -n 's/.*(R\(UN\)\{0,1\}PATH) *Library r\(un\)\{0,1\}path: \[\(.*\)\]$/\3/p'
}

# The loader the binaries name (PT_INTERP); all must name the same one.
interp=$(interpreter_of "${bins[0]}")
for b in "${bins[@]}"; do
  [[ $(interpreter_of "$b") == "$interp" ]] || die "$b names another loader than $interp"
done
[[ $interp == /* && -x $interp ]] || die "the loader $interp is missing"

acclib=usr/local/lib/accrue
driver_re='^(libcuda\.so\.1|libnvidia-ml\.so\.1)$'
declare -A src=()   # name in the tree -> source file (real path)
declare -A kind=()  # name in the tree -> system | accrue
order=()

is_system_dir() {
  case $1 in
    /lib | /usr/lib | /lib64 | /usr/lib64 | /lib/*-linux-gnu* | /usr/lib/*-linux-gnu*) return 0 ;;
    *) return 1 ;;
  esac
}

# deps FILE [COMMAND...]: what the loader resolves for FILE, into the arrays
# dep_name / dep_path (path empty: not found). COMMAND runs the loader with
# LD_TRACE_LOADED_OBJECTS=1, as ldd does (unlike `ld.so --list`, this goes on
# past a library not found); default: this machine's loader.
deps() {
  local f=$1 line rc=0 listing
  shift
  local cmd=("$@")
  [[ ${#cmd[@]} -gt 0 ]] || cmd=(env LD_TRACE_LOADED_OBJECTS=1 "$interp")
  dep_name=() dep_path=()
  listing=$("${cmd[@]}" "$f" 2>&1) || rc=$?
  while IFS= read -r line; do
    line=${line#"${line%%[![:space:]]*}"}
    case $line in
      *' => not found')
        dep_name+=("${line%% =>*}")
        dep_path+=("")
        ;;
      *'error while loading shared libraries: '*)
        line=${line#*error while loading shared libraries: }
        dep_name+=("${line%%:*}")
        dep_path+=("")
        ;;
      *' => '*' ('*)
        line=${line%' ('*}
        dep_name+=("${line%% => *}")
        dep_path+=("${line#* => }")
        ;;
      /*' ('*)
        line=${line%' ('*}
        dep_name+=("${line##*/}")
        dep_path+=("$line")
        ;;
      *' ('*) ;; # linux-vdso.so.1, in the kernel
      '') ;;
      *) if [[ $rc != 0 ]]; then die "cannot list the libraries of $f: $listing"; fi ;;
    esac
  done <<<"$listing"
  [[ $rc == 0 || ${#dep_name[@]} -gt 0 ]] || die "cannot list the libraries of $f: $listing"
}

add_lib() { # name path
  local name=$1 path=$2 real
  real=$(realpath "$path")
  if [[ -n ${src[$name]:-} ]]; then
    [[ ${src[$name]} == "$real" ]] || cmp -s "${src[$name]}" "$real" ||
      die "two different libraries are named $name: ${src[$name]} and $real"
    return 0
  fi
  src[$name]=$real
  if [[ $path == "$interp" ]] || is_system_dir "$(dirname "$path")"; then
    kind[$name]=system
  else
    kind[$name]=accrue
  fi
  order+=("$name")
}

# The binaries' closure: complete, or nothing is built.
for b in "${bins[@]}"; do
  deps "$b"
  missing=()
  for i in "${!dep_name[@]}"; do
    if [[ -z ${dep_path[$i]} ]]; then missing+=("${dep_name[$i]}"); fi
  done
  [[ ${#missing[@]} == 0 ]] || die "$b: libraries not found on this machine: ${missing[*]}"
  for i in "${!dep_name[@]}"; do add_lib "${dep_name[$i]}" "${dep_path[$i]}"; done
done
[[ -n ${src[libc.so.6]:-} ]] || die "the binaries do not load libc.so.6: not a glibc build?"

# Where libtorch lives, and whether this is a CUDA build.
torchlib=
if [[ -n ${src[libtorch_cpu.so]:-} ]]; then torchlib=$(dirname "${src[libtorch_cpu.so]}"); fi
if [[ $cuda == auto ]]; then
  if [[ -n ${src[libtorch_cuda.so]:-} ]]; then cuda=1; else cuda=0; fi
  [[ $cuda == 0 ]] || note "the binaries load libtorch_cuda.so: shipping the CUDA libraries"
fi

if [[ $cuda == 1 ]]; then
  [[ -n $torchlib ]] || die "--cuda: no binary loads libtorch_cpu.so"
  [[ -f $torchlib/libtorch_cuda.so ]] || die "--cuda: $torchlib has no libtorch_cuda.so (a CPU-only libtorch)"
  # The folders libtorch's RPATH names ($ORIGIN/../../nvidia/cu13/lib, ...).
  dirs=("$torchlib")
  IFS=: read -r -a rp <<<"$(rpath_of "$torchlib/libtorch_cpu.so")"
  for e in "${rp[@]}"; do
    case $e in
      '$ORIGIN'/* | '${ORIGIN}'/*) d=$torchlib/${e#*/} ;;
      /*) d=$e ;;
      *) continue ;;
    esac
    if [[ -d $d ]]; then dirs+=("$(realpath "$d")"); fi
  done
  extras=()
  for d in "${dirs[@]}"; do
    for f in "$d"/*.so "$d"/*.so.*; do
      [[ -f $f ]] || continue
      case ${f##*/} in
        # Python-only: the extension's own library, shared memory for
        # DataLoader workers, and the global-deps shim torch/__init__ loads.
        libtorch_python.so | libshm.so | libtorch_global_deps.so) continue ;;
      esac
      extras+=("$f")
    done
  done
  # In the tree they all share one folder, which the binaries' RPATH names:
  # resolve each with all these folders on the path, as it will be found.
  libpath=$(
    IFS=:
    echo "${dirs[*]}"
  )
  skipped=()
  for f in "${extras[@]}"; do
    deps "$f" env LD_TRACE_LOADED_OBJECTS=1 "$interp" --library-path "$libpath"
    missing=()
    for i in "${!dep_name[@]}"; do
      if [[ -z ${dep_path[$i]} && ! ${dep_name[$i]} =~ $driver_re ]]; then missing+=("${dep_name[$i]}"); fi
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
      skipped+=("${f##*/} (needs ${missing[*]})")
      continue
    fi
    add_lib "${f##*/}" "$f"
    for i in "${!dep_name[@]}"; do
      if [[ -n ${dep_path[$i]} ]]; then add_lib "${dep_name[$i]}" "${dep_path[$i]}"; fi
    done
  done
  for s in "${skipped[@]}"; do note "skipped optional plugin $s"; done
fi

# The system folder: where this machine's libc lives (/lib/x86_64-linux-gnu
# on Debian for x86_64), under usr/ as in a merged /usr.
multiarch=$(basename "$(dirname "$(realpath "${src[libc.so.6]}")")")
case $multiarch in
  *-linux-gnu*) syslib=usr/lib/$multiarch ;;
  *) syslib=usr/lib ;;
esac

mkdir -p "$out/usr/local/bin" "$out/$acclib" "$out/$syslib"

place() { # source destination
  if [[ $link == 1 ]] && ln "$1" "$2" 2>/dev/null; then return 0; fi
  cp --preserve=mode,timestamps "$1" "$2"
}

# A library whose RPATH leaves the tree (an absolute path: the build
# machine's), or names the current folder (an empty entry), gets $ORIGIN
# instead, on its own copy. Entries relative to $ORIGIN stay: they point
# inside or next to the tree, never at the build machine.
fix_rpath() { # file-in-tree
  local f=$1 rpath e bad=0
  rpath=$(rpath_of "$f")
  [[ -n $rpath ]] || return 0
  IFS=: read -r -a rp <<<"$rpath:"
  for e in "${rp[@]}"; do
    case $e in
      '$ORIGIN' | '$ORIGIN'/* | '${ORIGIN}' | '${ORIGIN}'/*) ;;
      *) bad=1 ;;
    esac
  done
  [[ $bad == 1 ]] || return 0
  if [[ $(stat -c %h "$f") != 1 ]]; then # a hard link: patch a copy
    cp --preserve=mode,timestamps "$f" "$f.tmp"
    mv -f "$f.tmp" "$f"
  fi
  chmod u+w "$f"
  patchelf --force-rpath --set-rpath '$ORIGIN' "$f"
  note "${f##*/}: RPATH $rpath -> \$ORIGIN"
}

for name in "${order[@]}"; do
  if [[ ${kind[$name]} == system ]]; then dest=$out/$syslib/$name; else dest=$out/$acclib/$name; fi
  place "${src[$name]}" "$dest"
  fix_rpath "$dest"
done

# The loader where the binaries name it: /lib64/ld-linux-x86-64.so.2 is
# usr/lib64/ld-linux-x86-64.so.2 -> ../lib/x86_64-linux-gnu/..., as Debian.
loader=${interp##*/}
[[ ${kind[$loader]:-} == system ]] || die "the loader $interp was not listed"
case $interp in
  /lib/* | /lib64/*) interp_in_tree=usr$interp ;;
  *) interp_in_tree=${interp#/} ;;
esac
if [[ $interp_in_tree != "$syslib/$loader" ]]; then
  mkdir -p "$out/$(dirname "$interp_in_tree")"
  ln -s "$(realpath --relative-to="$out/$(dirname "$interp_in_tree")" "$out/$syslib/$loader")" "$out/$interp_in_tree"
fi
ln -s usr/lib "$out/lib"
if [[ -d $out/usr/lib64 ]]; then ln -s usr/lib64 "$out/lib64"; fi

# The binaries: copied (or stripped into place), then their RPATH.
for b in "${bins[@]}"; do
  dest=$out/usr/local/bin/${b##*/}
  if [[ $strip == 1 ]]; then strip --strip-debug -o "$dest" "$b"; else cp "$b" "$dest"; fi
  chmod 0755 "$dest"
  patchelf --force-rpath --set-rpath '$ORIGIN/../lib/accrue' "$dest"
done

# Users, name lookup, scratch space.
mkdir -p "$out/etc" "$out/tmp" "$out/home/nonroot"
chmod 1777 "$out/tmp"
cat >"$out/etc/passwd" <<'PASSWD'
root:x:0:0:root:/root:/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin
PASSWD
cat >"$out/etc/group" <<'GROUP'
root:x:0:
nonroot:x:65532:
GROUP
cat >"$out/etc/nsswitch.conf" <<'NSS'
passwd: files
group: files
hosts: files dns
NSS
if [[ $(id -u) == 0 ]]; then chown 65532:65532 "$out/home/nonroot"; fi
chmod 0755 "$out/home/nonroot"

# Self-check: the tree's own loader, only the tree's system folder (the
# default search path in the image), no cache. Everything must resolve, and
# inside the tree.
check() { # file
  local i p
  deps "$1" env -i LD_TRACE_LOADED_OBJECTS=1 "$out/$interp_in_tree" --inhibit-cache --library-path "$out/$syslib:$out/$acclib"
  for i in "${!dep_name[@]}"; do
    p=${dep_path[$i]}
    if [[ -z $p ]]; then
      [[ ${dep_name[$i]} =~ $driver_re ]] || die "check: $1 does not find ${dep_name[$i]} in the tree"
      continue
    fi
    [[ $(realpath "$p") == "$out"/* ]] || die "check: $1 loads ${dep_name[$i]} from $p, outside the tree"
  done
}
for b in "${bins[@]}"; do
  # Binaries: only the system folder; their own RPATH must find the rest.
  deps "$out/usr/local/bin/${b##*/}" env -i LD_TRACE_LOADED_OBJECTS=1 "$out/$interp_in_tree" --inhibit-cache --library-path "$out/$syslib"
  for i in "${!dep_name[@]}"; do
    p=${dep_path[$i]}
    [[ -n $p ]] || die "check: ${b##*/} does not find ${dep_name[$i]} in the tree"
    [[ $(realpath "$p") == "$out"/* ]] || die "check: ${b##*/} loads ${dep_name[$i]} from $p, outside the tree"
  done
done
if [[ $cuda == 1 ]]; then
  for name in "${order[@]}"; do
    if [[ ${kind[$name]} == accrue ]]; then check "$out/$acclib/$name"; fi
  done
fi

n_acc=0 n_sys=0
for name in "${order[@]}"; do
  if [[ ${kind[$name]} == accrue ]]; then n_acc=$((n_acc + 1)); else n_sys=$((n_sys + 1)); fi
done
note "$out: ${#bins[@]} binaries, $n_acc libraries in /$acclib, $n_sys in /$syslib (cuda: $cuda)"
