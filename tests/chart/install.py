#!/usr/bin/env python3
"""Installs, upgrades or uninstalls the chart in this repository with Helm's
own engine (helm-python-sdk embeds Helm v4's Go SDK), as `helm install
--wait` does: the node suite (tests/cluster_node*.rs) installs pinswap this
way.

usage: install.py install|upgrade|uninstall --kubeconfig FILE --namespace NS
                  --name RELEASE [--values FILE.json] [--timeout SECONDS]
"""
import argparse
import json
import pathlib
import sys

import helm_python

CHART = pathlib.Path(__file__).resolve().parents[2] / "charts" / "pinswap"


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("verb", choices=["install", "upgrade", "uninstall"])
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--values")
    p.add_argument("--timeout", type=int, default=180)
    args = p.parse_args(argv)
    values = json.loads(pathlib.Path(args.values).read_text()) if args.values else {}
    cfg = helm_python.Config(kubeconfig_path=args.kubeconfig, namespace=args.namespace)
    try:
        if args.verb == "uninstall":
            cfg.uninstall(args.name, wait="watcher", timeout=args.timeout, ignore_not_found=True)
            return
        chart = helm_python.Chart.load(str(CHART))
        try:
            if args.verb == "install":
                rel = cfg.install(chart, args.name, values, namespace=args.namespace,
                                  create_namespace=True, wait="watcher", timeout=args.timeout)
            else:
                rel = cfg.upgrade(chart, args.name, values, namespace=args.namespace,
                                  wait="watcher", timeout=args.timeout)
        finally:
            chart.close()
        info = rel.get("info") if isinstance(rel, dict) else None
        print(json.dumps(info) if info is not None else "ok")
    except helm_python.HelmError as e:
        sys.exit(f"helm {args.verb} {args.name}: {e}")
    finally:
        cfg.close()


if __name__ == "__main__":
    main(sys.argv[1:])
