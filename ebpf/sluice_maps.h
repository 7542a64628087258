/* Sluice TC classifier ABI: every map, key and value the kernel program and the gateway share.
 *
 * This header is the one place the layout is defined; gateway/datapath/maps.py mirrors it with
 * ctypes structures of the same field order and sizes (checked by tests). Sizes that fix a
 * map's capacity arrive as -D cflags from the policy (docs/contributing.md, "eBPF"): nothing
 * here is edited to configure the classifier, and run-time knobs (budgets, rapid-reset
 * thresholds, ports, priority classes) live in maps the gateway writes.
 *
 * Maps are pinned under SLUICE_PIN_DIR (a bpffs directory, -DSLUICE_PIN_DIR="...") when it is
 * defined, so a restarted gateway re-attaches to the same counters, per-source buckets and deny
 * entries (bcc reuses a pinned map when the path exists). Without it, maps live exactly as long
 * as the attached program.
 */
#ifndef SLUICE_MAPS_H
#define SLUICE_MAPS_H

#ifndef MAX_FLOWS
#define MAX_FLOWS 65536
#endif
#ifndef MAX_SOURCES
#define MAX_SOURCES 65536
#endif
#ifndef MAX_DENY
#define MAX_DENY 16384
#endif
/* HTTP/2 frame headers parsed per skb (a GSO skb on a veth may carry up to 64 KiB). The
 * verifier walks every iteration: 64 frames verify in ~3 s. */
#ifndef H2_MAX_FRAMES
#define H2_MAX_FRAMES 64
#endif
#ifndef MAX_PORTS
#define MAX_PORTS 64
#endif
#define MAX_CLASSES 8

/* ports map flags */
#define PORT_H2C 1   /* parse HTTP/2 frames, stream budget and rapid-reset detection */
#define PORT_ADMIT 2 /* SYN budget and deny list apply */

/* Source address: IPv4 as an IPv4-mapped IPv6 address (::ffff:a.b.c.d). */
struct src_key {
    __u8 addr[16];
};

struct flow_key {
    __u8 saddr[16];
    __u8 daddr[16];
    __u16 sport; /* host byte order */
    __u16 dport; /* host byte order */
    __u32 pad;
};

/* flow_stats.h2_state */
#define H2_UNKNOWN 0 /* no payload seen yet: sync on the first segment */
#define H2_SYNCED 1  /* next_seq / skip are valid */
#define H2_LOST 2    /* lost track: resync on a segment that starts with a plausible frame */

struct flow_stats {
    __u64 packets;
    __u64 bytes;
    __u64 headers;
    __u64 data;
    __u64 rst_stream;
    __u64 settings;
    __u64 ping;
    __u64 first_ns;
    __u64 last_ns;
    __u64 win_start_ns; /* rapid-reset window */
    __u32 win_headers;
    __u32 win_rst;
    __u32 next_seq; /* TCP sequence number the next in-order payload byte carries */
    __u32 skip;     /* bytes of the current frame still to come after next_seq */
    __u32 h2_state;
    __u32 blocked;  /* BLOCK_*: nonzero = every further packet of the flow is dropped */
    __u32 hb_bytes; /* bytes of the open header block, frame headers included; 0 = none open */
    __u32 part_len; /* bytes of a frame header split across segments, carried (0..8) */
    __u64 part_hdr; /* their first 5 bytes (length, type, flags), big-endian */
    __u64 ping_win_start_ns; /* PING-flood window */
    __u32 win_ping;          /* PINGs (not ACKs) received in the window */
    __u32 pad;
};

/* flow_stats.blocked: why the flow is dropped */
#define BLOCK_RAPID_RESET 1  /* RST_STREAM / HEADERS ratio over the window */
#define BLOCK_HEADER_BLOCK 2 /* one header block (HEADERS + CONTINUATION) over max_header_block */
#define BLOCK_PING_FLOOD 3   /* more than ping_max PINGs in the ping window */

/* Per-source token buckets. Tokens are kept in milli-tokens so slow rates refill smoothly. */
struct src_state {
    __u64 syn_tokens;
    __u64 syn_last_ns;
    __u64 stream_tokens;
    __u64 stream_last_ns;
    __u64 syn_drops;
    __u64 stream_drops;
    __u64 deny_drops;
    __u64 syns;
    __u64 streams;
};

/* Budgets per source: key = source, or the all-zero key for the default. rate 0 = unlimited. */
struct budget {
    __u32 syn_rate;  /* new connections per second */
    __u32 syn_burst;
    __u32 stream_rate; /* new HTTP/2 streams (HEADERS frames) per second */
    __u32 stream_burst;
};

/* config[0]: run-time settings written by the gateway. */
struct config {
    __u64 rr_window_ns;   /* rapid-reset window */
    __u32 rr_min_headers; /* no verdict before this many HEADERS in the window */
    __u32 rr_ratio_pct;   /* RST_STREAM * 100 >= ratio * HEADERS -> blocked */
    __u32 max_frame;      /* largest plausible frame length when resyncing */
    __u32 pad;
    __u64 ping_window_ns;   /* PING-flood window */
    __u32 ping_max;         /* PINGs (not ACKs) per window and flow before it is blocked; 0 = off */
    __u32 max_header_block; /* bytes of one header block before the flow is blocked; 0 = off */
};

struct class_prio {
    __u32 priority; /* skb->priority for the class; 0 = leave it */
    __u32 mark;     /* skb->mark for the class; 0 = leave it */
};

/* Global counters, per CPU. Index names are mirrored in maps.py STAT_NAMES. */
enum sluice_stat {
    ST_PACKETS = 0,
    ST_BYTES,
    ST_SYN_DROP,
    ST_STREAM_DROP,
    ST_DENY_DROP,
    ST_RR_DROP,
    ST_RR_FLOWS,
    ST_H2_RESYNC,
    ST_H2_LOST,
    ST_DENY_EXPIRED,
    ST_EGRESS_PACKETS,
    ST_EGRESS_CLASSIFIED,
    ST_HB_FLOWS,    /* flows blocked for an oversized (or unfollowable) header block */
    ST_PING_FLOWS,  /* flows blocked for a PING flood */
    ST_FLOOD_DROP,  /* packets dropped on flows blocked for either */
    ST_H2_OOO_DROP, /* out-of-order segments dropped inside a header block (kept in sync) */
    ST_MAX,
};

/* The h2c frame walker's working state for one packet (per-CPU scratch, not shared with the
 * gateway): its position in the flow, copied from flow_stats and committed only if the packet
 * is admitted, and what it counted in the packet. */
struct h2_walk {
    __u32 next_seq;
    __u32 skip;
    __u32 h2_state;
    __u32 hb_bytes;
    __u32 part_len;
    __u32 pad;
    __u64 part_hdr;
};

struct h2_counts {
    __u32 headers;
    __u32 data;
    __u32 rst;
    __u32 settings;
    __u32 ping;
    __u32 ping_req; /* PINGs without the ACK flag: the ones the server must answer */
    __u32 verdict;  /* H2_PASS / H2_DROP / H2_BLOCK */
    __u32 pad;
};

struct h2_scratch {
    struct h2_walk w;
    struct h2_counts c;
};

#ifdef SLUICE_PIN_DIR
#define SLUICE_MAP(type, k, v, name, max) \
    BPF_TABLE_PINNED(type, k, v, name, max, SLUICE_PIN_DIR "/" #name)
#else
#define SLUICE_MAP(type, k, v, name, max) BPF_TABLE(type, k, v, name, max)
#endif

SLUICE_MAP("lru_hash", struct flow_key, struct flow_stats, flows, MAX_FLOWS);
SLUICE_MAP("lru_hash", struct src_key, struct src_state, sources, MAX_SOURCES);
SLUICE_MAP("hash", struct src_key, struct budget, budgets, MAX_SOURCES);
SLUICE_MAP("hash", struct src_key, __u64, deny, MAX_DENY); /* value: expiry, CLOCK_MONOTONIC ns */
SLUICE_MAP("hash", __u16, __u32, ports, MAX_PORTS);        /* local port -> PORT_* flags */
SLUICE_MAP("hash", __u16, __u32, port_class, MAX_PORTS);   /* local port -> class index */
SLUICE_MAP("hash", struct src_key, __u32, src_class, MAX_SOURCES); /* peer -> class index */
SLUICE_MAP("array", __u32, struct class_prio, classes, MAX_CLASSES);
SLUICE_MAP("array", __u32, struct config, config, 1);
SLUICE_MAP("percpu_array", __u32, __u64, stats, ST_MAX);
BPF_TABLE("percpu_array", __u32, struct h2_scratch, scratch, 1); /* never pinned: per packet */

#endif /* SLUICE_MAPS_H */
