"""The public API (SPEC.md section 3): every exported name resolves from the top level, lazily,
so `import gagar_jax` pulls in no JAX."""
import os
import subprocess
import sys

import gagar_jax


def test_every_export_resolves_to_its_defining_module():
    for name, _module in gagar_jax._EXPORTS.items():
        obj = getattr(gagar_jax, name)
        assert getattr(obj, "__name__", name) == name, name
        assert obj.__module__.startswith("gagar_jax"), (name, obj.__module__)
    assert set(gagar_jax.__all__) == set(gagar_jax._EXPORTS)
    assert "Feed" in dir(gagar_jax)


def test_unknown_name_is_an_attribute_error():
    try:
        gagar_jax.no_such_name  # noqa: B018 -- the lookup itself must raise AttributeError
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("expected AttributeError")


def test_import_is_cheap_and_jax_free():
    code = ("import sys, gagar_jax; assert 'jax' not in sys.modules, 'jax imported';"
            "from gagar_jax import gagar_advantages; assert 'jax' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


def test_python_dash_m_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "gagar_jax", "--help"], capture_output=True,
                         text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert "--config" in out.stdout
