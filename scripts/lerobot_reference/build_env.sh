#!/usr/bin/env bash
# Build a separate environment holding LeRobot's own dataset code (the `lerobot-dataset` package), to write
# datasets with LeRobot's writer and open this project's exports with LeRobot's loader. It cannot be the
# project's environment: lerobot pins torch < 2.12, and lerobot-dataset downgrades numpy.
#
#   scripts/lerobot_reference/build_env.sh DIR        # then: DIR/bin/lerobot-python script.py ...
#
# Two gaps of the PyPI wheels are bridged, both inside DIR:
#  - torchvision: its only build for torch 2.13.0 links CUDA and fails to import on a CPU machine, while
#    lerobot-dataset imports `torchvision.transforms` at import time (and uses it only for ToTensor, in code
#    this project does not call). DIR/shim/torchvision provides that one class.
#  - FFmpeg: torchcodec (LeRobot's default video decoder) loads the system's libav*.so.61; PyAV's wheel
#    bundles the same FFmpeg 7 libraries, which DIR/ffmpeg links under their plain names.
# `DIR/bin/lerobot-python` runs python with both in place.
set -euo pipefail
DIR=${1:?usage: build_env.sh DIR}
PY=${PYTHON:-python3}
"$PY" -m venv "$DIR"
"$DIR/bin/pip" install -q "torch==2.13.0" "lerobot-dataset==0.4.4" "torchcodec==0.13.0" "av>=15,<16"
SITE=$("$DIR/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$DIR/shim/torchvision" "$DIR/ffmpeg"
cat > "$DIR/shim/torchvision/__init__.py" <<'PY'
"""Stand-in for torchvision (its torch 2.13.0 wheel links CUDA): only what lerobot-dataset imports."""
from . import transforms  # noqa: F401
PY
cat > "$DIR/shim/torchvision/transforms.py" <<'PY'
import numpy as np
import torch


class ToTensor:
    """(H, W, C) uint8 image -> (C, H, W) float in [0, 1]."""

    def __call__(self, pic):
        a = np.asarray(pic)
        a = a[:, :, None] if a.ndim == 2 else a
        return torch.from_numpy(a.copy()).permute(2, 0, 1).float().div(255)
PY
for lib in "$SITE"/av.libs/lib{avcodec,avdevice,avfilter,avformat,avutil,swresample,swscale}-*.so.*; do
  base=$(basename "$lib")
  name=${base%%-*}
  major=$(echo "$base" | sed -E 's/.*\.so\.([0-9]+).*/\1/')
  ln -sf "$lib" "$DIR/ffmpeg/$name.so.$major"
done
cat > "$DIR/bin/lerobot-python" <<SH
#!/usr/bin/env bash
export PYTHONPATH="$DIR/shim\${PYTHONPATH:+:\$PYTHONPATH}"
export LD_LIBRARY_PATH="$DIR/ffmpeg\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$DIR/bin/python" "\$@"
SH
chmod +x "$DIR/bin/lerobot-python"
"$DIR/bin/lerobot-python" -c "import ledataset.datasets.lerobot_dataset, torchcodec.decoders; print('LeRobot reference environment ready: $DIR/bin/lerobot-python')"
