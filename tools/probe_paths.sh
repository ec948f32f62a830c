# Sourced by the probes' scripts (deviceless_probe.sh, override_probe.sh): where $PYTHON's
# packages are, and the first folder that holds a file (the headers and libraries a probe
# is built against). PROBE names the script in a message.
site() { "$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
first_dir_with() {  # first_dir_with FILE DIR...: the first DIR holding FILE
    local f="$1"; shift
    for d in "$@"; do [ -n "$d" ] && [ -e "$d/$f" ] && { echo "$d"; return 0; }; done
    echo "$PROBE: $f not found in: $* (set the matching *_INC; cudnn-frontend's headers are the include/ folder of the nvidia-cudnn-frontend==1.28.0 wheel)" >&2; return 1
}
