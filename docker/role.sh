#!/bin/sh
# role.sh ROLE HOST PORT: shape the WAN interface with netem, then run one demo role.
set -eu
role=$1 host=$2 port=$3
wan_if=$(ip -o -4 route get "$(getent hosts md | awk '{print $1}')" | sed -n 's/.* dev \([^ ]*\).*/\1/p')
[ "$role" = main ] && wan_if=$(ip -o -4 route get "$(getent hosts p | awk '{print $1}')" | sed -n 's/.* dev \([^ ]*\).*/\1/p')
tc qdisc replace dev "$wan_if" root netem delay "$WAN_DELAY" loss "$WAN_LOSS" rate "$WAN_RATE"
addr=$(getent hosts "$host" | awk '{print $1}')
cfg=$(cat <<JSON
{"blocks": 8192, "step_time_s": 0.02, "rtt_s": 0.03, "rate_bps": 25e6, "ttft_target_s": 0.15,
 "sessions": 8, "turns": 4, "max_tokens": 32, "seed": 7, "request_timeout_s": 60,
 "out": "/out/records.json", "control": "tcp://$addr:$port", "data_host": "$addr",
 "rendezvous": "tcp://p:5550"}
JSON
)
exec python -m pddnet.demo._roles "$role" "$cfg"
