#!/usr/bin/env bash
# On the lent GPU machine (torch + CUDA in its image, no pyzmq/msgspec/textual): install the carried
# wheels (.whl, made with `pip download --python-version 3.12 ...`) and this checkout into /tmp/site,
# and make that directory a site directory of the image's Python, so its .pth files run and
# TORCHTOP=1 / `torchtop run` start the agent there as on a normal install.
#   source tests/gpu/setup.sh
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade --target /tmp/site . >/dev/null
site_dir=$(python3 -c 'import site; print(site.getsitepackages()[0])')
echo "import site; site.addsitedir('/tmp/site')" > "$site_dir/torchtop-device.pth"
export PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
python3 -c "import torch, torchtop.agent, torchtop.monitor, zmq, msgspec; print('gpu setup:', torch.__version__, torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPUs')"
set +e
