#!/usr/bin/env bash
# Installs the system tools the test-suite talks to (mosquitto and its clients, kcat, Java for Spark,
# headless Chromium for the dashboard, Prometheus and promtool for the metrics, rules and scrape
# tests) when missing.
# Where apt is unavailable, the tests that need them skip with a clear reason.
set -u
need=()
command -v mosquitto_pub >/dev/null 2>&1 || need+=(mosquitto-clients)
command -v mosquitto >/dev/null 2>&1 || need+=(mosquitto)
command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)
command -v kcat >/dev/null 2>&1 || need+=(kcat)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v chromium >/dev/null 2>&1 || need+=(chromium)  # the dashboard test (headless)
# promtool (check metrics, test rules) and a Prometheus server that scrapes a gateway
{ command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; } || need+=(prometheus)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: installing ${need[*]}"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}") >/tmp/lightgate-apt.log 2>&1 \
    || echo "system-deps: apt-get failed (see /tmp/lightgate-apt.log); dependent tests will skip"
else
  echo "system-deps: missing ${need[*]}; install them (e.g. apt-get install ${need[*]}) or the dependent tests skip"
fi
if ! command -v java >/dev/null 2>&1; then
  echo "system-deps: Java 17 is required for the Spark tests: apt-get install openjdk-17-jre-headless"
fi
exit 0
