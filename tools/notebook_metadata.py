"""Stamp every notebook with the metadata JupyterLab writes when it opens one, so notebooks open unmodified.

JupyterLab adds `language_info` on load when it is missing and sets `kernelspec` and `language_info` from the started
kernel; any difference marks the notebook modified. settings.ini keeps `language_info` through `nbdev_clean`
(`allowed_metadata_keys`), and the install step registers the kernel under the display name `nbdev_clean` writes
(`python -m ipykernel install --sys-prefix --name python3 --display-name python3`), so a cleaned notebook keeps both.
Run once after adding a notebook: `python tools/notebook_metadata.py nbs/*.ipynb`, then `nbdev_clean`.
`language_info.version` is this Python's version: on another patch release JupyterLab still updates it once.
"""
import json, sys
from ipykernel.ipkernel import IPythonKernel
from jupyter_client.kernelspec import KernelSpecManager

def stamp(path: str, spec) -> bool:
    text = open(path).read(); nb = json.loads(text)
    nb["metadata"]["kernelspec"] = dict(display_name=spec.display_name, language=spec.language, name="python3")
    nb["metadata"]["language_info"] = dict(IPythonKernel.language_info)
    new = json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"   # nbdev_clean's layout
    if new != text: open(path, "w").write(new)
    return new != text

if __name__ == "__main__":
    spec = KernelSpecManager().get_kernel_spec("python3")
    changed = [p for p in sys.argv[1:] if stamp(p, spec)]
    print(f"{len(changed)} of {len(sys.argv) - 1} notebooks stamped")
