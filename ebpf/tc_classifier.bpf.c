/* Sluice TC classifier: per-flow accounting, per-source admission, deny list, rapid-reset
 * detection (ingress) and priority-class marking (egress). Compiled by bcc; maps in
 * sluice_maps.h. Attached with direct-action on clsact ingress (sluice_ingress) and egress
 * (sluice_egress).
 *
 * Scope (DESIGN.md "eBPF honest scope"): TC sees packets, not streams. HTTP/2 frames are only
 * visible for cleartext h2c on ports flagged PORT_H2C; TLS traffic is counted per flow only.
 *
 * HTTP/2 frame tracking across segments (RFC 9113 section 4.1: 9-byte frame header, 24-bit
 * length): per flow we keep the sequence number of the next in-order payload byte (next_seq)
 * and how many bytes of the current frame are still to come (skip). An in-order segment is parsed
 * from `skip` on, following frame lengths for at most H2_MAX_FRAMES headers. The choice is
 * conservative: a retransmission (seq before next_seq) is not parsed again; a gap, a frame header
 * split across two segments, or more frames than H2_MAX_FRAMES in one skb lose sync (H2_LOST),
 * and counting resumes only at a later segment that *starts* with a plausible frame header
 * (known type, length <= max_frame, reserved bit clear, stream id parity right). Frames are
 * therefore never double-counted, and may be under-counted while unsynced (ST_H2_LOST counts it).
 *
 * Unsupported, passed without parsing: VLAN tags, IPv6 extension headers, IPv4 fragments.
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/tcp.h>

#include "sluice_maps.h"

#define H2_DATA 0x0
#define H2_HEADERS 0x1
#define H2_RST_STREAM 0x3
#define H2_SETTINGS 0x4
#define H2_PING 0x6
#define H2_MAX_TYPE 0x9
#define H2_PREFACE_LEN 24

struct pkt {
    struct flow_key key;
    __u32 payload_off;
    __u32 payload_len;
    __u32 seq;
    __u8 syn;
    __u8 ack;
    __u8 rst;
    __u8 fin;
};

static __always_inline void stat_add(__u32 idx, __u64 n)
{
    __u64 *v = stats.lookup(&idx);
    if (v)
        *v += n; /* per-CPU slot: no atomics needed */
}

/* Fill addresses, ports and payload bounds; returns 0 for TCP over IPv4/IPv6, -1 otherwise. */
static __always_inline int parse(struct __sk_buff *skb, struct pkt *p)
{
    __u16 proto;
    __u32 l4off;
    __u32 l3len;
    if (bpf_skb_load_bytes(skb, 12, &proto, sizeof(proto)) < 0)
        return -1;
    if (proto == bpf_htons(ETH_P_IP)) {
        struct iphdr ip;
        if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip, sizeof(ip)) < 0)
            return -1;
        if (ip.protocol != IPPROTO_TCP || ip.ihl < 5)
            return -1;
        if (ip.frag_off & bpf_htons(0x3fff)) /* MF or offset: fragments are not parsed */
            return -1;
        p->key.saddr[10] = 0xff;
        p->key.saddr[11] = 0xff;
        __builtin_memcpy(&p->key.saddr[12], &ip.saddr, 4);
        p->key.daddr[10] = 0xff;
        p->key.daddr[11] = 0xff;
        __builtin_memcpy(&p->key.daddr[12], &ip.daddr, 4);
        l4off = ETH_HLEN + ip.ihl * 4;
        l3len = bpf_ntohs(ip.tot_len);
        if (l3len == 0) /* BIG TCP GSO: the length lives in the skb only */
            l3len = skb->len - ETH_HLEN;
        l3len = l3len > ip.ihl * 4 ? l3len - ip.ihl * 4 : 0;
    } else if (proto == bpf_htons(ETH_P_IPV6)) {
        struct ipv6hdr ip6;
        if (bpf_skb_load_bytes(skb, ETH_HLEN, &ip6, sizeof(ip6)) < 0)
            return -1;
        if (ip6.nexthdr != IPPROTO_TCP)
            return -1;
        __builtin_memcpy(p->key.saddr, &ip6.saddr, 16);
        __builtin_memcpy(p->key.daddr, &ip6.daddr, 16);
        l4off = ETH_HLEN + sizeof(struct ipv6hdr);
        l3len = bpf_ntohs(ip6.payload_len);
        if (l3len == 0)
            l3len = skb->len - l4off;
    } else {
        return -1;
    }
    struct tcphdr tcp;
    if (bpf_skb_load_bytes(skb, l4off, &tcp, sizeof(tcp)) < 0)
        return -1;
    __u32 thl = tcp.doff * 4;
    p->key.sport = bpf_ntohs(tcp.source);
    p->key.dport = bpf_ntohs(tcp.dest);
    p->seq = bpf_ntohl(tcp.seq);
    p->syn = tcp.syn;
    p->ack = tcp.ack;
    p->rst = tcp.rst;
    p->fin = tcp.fin;
    p->payload_off = l4off + thl;
    p->payload_len = l3len > thl ? l3len - thl : 0;
    return 0;
}

static __always_inline struct src_key src_of(struct pkt *p)
{
    struct src_key s = {};
    __builtin_memcpy(s.addr, p->key.saddr, 16);
    return s;
}

/* Take n tokens (n * 1000 milli-tokens) from a bucket; returns 1 when admitted. */
static __always_inline int take(__u64 *tokens, __u64 *last, __u32 rate, __u32 burst, __u64 now,
                                __u32 n)
{
    if (rate == 0)
        return 1;
    __u64 cap = (__u64)(burst ? burst : 1) * 1000;
    if (*last == 0) {
        *tokens = cap;
    } else if (now > *last) {
        __u64 elapsed = now - *last;
        if (elapsed > 100000000000ULL) /* 100 s: caps the product below 2^64 */
            elapsed = 100000000000ULL;
        *tokens += elapsed * rate / 1000000; /* ns * tokens/s * 1000 / 1e9 */
        if (*tokens > cap)
            *tokens = cap;
    }
    *last = now;
    __u64 need = (__u64)n * 1000;
    if (*tokens < need)
        return 0;
    *tokens -= need;
    return 1;
}

static __always_inline struct budget *budget_for(struct src_key *s)
{
    struct budget *b = budgets.lookup(s);
    if (b)
        return b;
    struct src_key any = {};
    return budgets.lookup(&any);
}

static __always_inline int plausible(__u32 len, __u8 type, __u32 sid, __u32 max_frame)
{
    if (type > H2_MAX_TYPE || len > max_frame || (sid & 0x80000000))
        return 0;
    if (type == H2_SETTINGS || type == H2_PING)
        return sid == 0;
    if (type == H2_HEADERS || type == H2_DATA || type == H2_RST_STREAM)
        return sid != 0;
    return 1;
}

struct h2_counts {
    __u32 headers;
    __u32 data;
    __u32 rst;
    __u32 settings;
    __u32 ping;
};

/* Parse the frames of one in-order segment into `c`; updates next_seq/skip/h2_state in `st`
 * (the caller commits `st` only if the packet is admitted). */
static __always_inline void h2_parse(struct __sk_buff *skb, struct pkt *p, struct flow_stats *st,
                                     struct h2_counts *c, struct config *cfg)
{
    __u32 len = p->payload_len;
    __u32 end = p->payload_off + len;
    __u32 off = p->payload_off;
    __u32 max_frame = cfg ? cfg->max_frame : 16777215;
    if (max_frame == 0)
        max_frame = 16777215;

    if (st->h2_state == H2_SYNCED) {
        __s32 d = (__s32)(p->seq - st->next_seq);
        if (d < 0) /* retransmission (or overlap): already counted */
            return;
        if (d > 0) { /* gap: we cannot know where frames begin */
            st->h2_state = H2_LOST;
            stat_add(ST_H2_LOST, 1);
        } else {
            if (st->skip >= len) {
                st->skip -= len;
                st->next_seq = p->seq + len;
                return;
            }
            off += st->skip;
        }
    }
    if (st->h2_state != H2_SYNCED) {
        /* Sync point: the client preface, or a segment starting with a plausible header. */
        char pri[4] = {};
        if (bpf_skb_load_bytes(skb, off, pri, 4) < 0)
            return;
        if (pri[0] == 'P' && pri[1] == 'R' && pri[2] == 'I' && pri[3] == ' ') {
            off += H2_PREFACE_LEN;
        } else {
            __u8 h[9];
            if (len < 9 || bpf_skb_load_bytes(skb, off, h, 9) < 0)
                return;
            __u32 flen = ((__u32)h[0] << 16) | ((__u32)h[1] << 8) | h[2];
            __u32 sid = (((__u32)h[5] << 24) | ((__u32)h[6] << 16) | ((__u32)h[7] << 8) | h[8]);
            if (!plausible(flen, h[3], sid, max_frame))
                return;
        }
        if (st->h2_state == H2_LOST)
            stat_add(ST_H2_RESYNC, 1);
        st->h2_state = H2_SYNCED;
    }

    int i;
    for (i = 0; i < H2_MAX_FRAMES; i++) {
        if (off >= end)
            break;
        __u8 h[9];
        if (off + 9 > end || bpf_skb_load_bytes(skb, off, h, 9) < 0) {
            /* frame header split across segments: conservative, lose sync */
            st->h2_state = H2_LOST;
            stat_add(ST_H2_LOST, 1);
            return;
        }
        __u32 flen = ((__u32)h[0] << 16) | ((__u32)h[1] << 8) | h[2];
        switch (h[3]) {
        case H2_HEADERS: c->headers++; break;
        case H2_DATA: c->data++; break;
        case H2_RST_STREAM: c->rst++; break;
        case H2_SETTINGS: c->settings++; break;
        case H2_PING: c->ping++; break;
        default: break;
        }
        off += 9 + flen;
    }
    if (off < end) { /* more frames than H2_MAX_FRAMES in this skb */
        st->h2_state = H2_LOST;
        stat_add(ST_H2_LOST, 1);
        return;
    }
    st->skip = off - end;
    st->next_seq = p->seq + len;
}

int sluice_ingress(struct __sk_buff *skb)
{
    struct pkt p = {};
    if (parse(skb, &p) < 0)
        return TC_ACT_OK;
    __u64 now = bpf_ktime_get_ns();
    stat_add(ST_PACKETS, 1);
    stat_add(ST_BYTES, skb->len);

    __u16 lport = p.key.dport;
    __u32 *pflags = ports.lookup(&lport);
    __u32 flags = pflags ? *pflags : 0;
    struct src_key src = src_of(&p);

    /* Deny list (written by the gateway when the overload colour is red). */
    if (flags) {
        __u64 *exp = deny.lookup(&src);
        if (exp) {
            if (now < *exp) {
                struct src_state *ss = sources.lookup(&src);
                if (ss)
                    __sync_fetch_and_add(&ss->deny_drops, 1);
                stat_add(ST_DENY_DROP, 1);
                return TC_ACT_SHOT;
            }
            deny.delete(&src); /* expired: entries remove themselves */
            stat_add(ST_DENY_EXPIRED, 1);
        }
    }

    /* SYN budget before any flow state: a SYN flood must not churn the flow table. */
    struct src_state *ss = 0;
    if ((flags & PORT_ADMIT) && p.syn && !p.ack) {
        struct src_state sz = {};
        ss = sources.lookup_or_try_init(&src, &sz);
        struct budget *b = budget_for(&src);
        if (ss && b) {
            if (!take(&ss->syn_tokens, &ss->syn_last_ns, b->syn_rate, b->syn_burst, now, 1)) {
                __sync_fetch_and_add(&ss->syn_drops, 1);
                stat_add(ST_SYN_DROP, 1);
                return TC_ACT_SHOT;
            }
            __sync_fetch_and_add(&ss->syns, 1);
        }
    }

    struct flow_stats zero = {};
    zero.first_ns = now;
    struct flow_stats *fs = flows.lookup_or_try_init(&p.key, &zero);
    if (!fs)
        return TC_ACT_OK;
    if (fs->blocked) {
        stat_add(ST_RR_DROP, 1);
        return TC_ACT_SHOT;
    }

    if ((flags & PORT_H2C) && p.payload_len > 0) {
        __u32 k0 = 0;
        struct config *cfg = config.lookup(&k0);
        struct flow_stats st = {};
        st.next_seq = fs->next_seq;
        st.skip = fs->skip;
        st.h2_state = fs->h2_state;
        struct h2_counts c = {};
        h2_parse(skb, &p, &st, &c, cfg);

        if (c.headers) {
            struct src_state sz = {};
            ss = sources.lookup_or_try_init(&src, &sz);
            struct budget *b = budget_for(&src);
            if (ss && b && b->stream_rate) {
                /* admission is per segment: every HEADERS frame in it must fit */
                if (!take(&ss->stream_tokens, &ss->stream_last_ns, b->stream_rate,
                          b->stream_burst, now, c.headers)) {
                    /* dropped: flow state not committed, so the retransmission is parsed
                     * again once the bucket refills */
                    __sync_fetch_and_add(&ss->stream_drops, 1);
                    stat_add(ST_STREAM_DROP, 1);
                    return TC_ACT_SHOT;
                }
            }
            if (ss)
                __sync_fetch_and_add(&ss->streams, c.headers);
        }

        fs->next_seq = st.next_seq;
        fs->skip = st.skip;
        fs->h2_state = st.h2_state;
        fs->headers += c.headers;
        fs->data += c.data;
        fs->rst_stream += c.rst;
        fs->settings += c.settings;
        fs->ping += c.ping;

        /* Rapid reset (CVE-2023-44487): many streams opened and cancelled at once. */
        if (cfg && cfg->rr_window_ns && (c.headers || c.rst)) {
            if (now - fs->win_start_ns > cfg->rr_window_ns) {
                fs->win_start_ns = now;
                fs->win_headers = 0;
                fs->win_rst = 0;
            }
            fs->win_headers += c.headers;
            fs->win_rst += c.rst;
            if (fs->win_headers >= cfg->rr_min_headers &&
                (__u64)fs->win_rst * 100 >= (__u64)cfg->rr_ratio_pct * fs->win_headers) {
                fs->blocked = 1;
                stat_add(ST_RR_FLOWS, 1);
            }
        }
    }

    __sync_fetch_and_add(&fs->packets, 1);
    __sync_fetch_and_add(&fs->bytes, skb->len);
    fs->last_ns = now;
    return TC_ACT_OK;
}

int sluice_egress(struct __sk_buff *skb)
{
    struct pkt p = {};
    if (parse(skb, &p) < 0)
        return TC_ACT_OK;
    stat_add(ST_EGRESS_PACKETS, 1);
    struct src_key peer = {};
    __builtin_memcpy(peer.addr, p.key.daddr, 16);
    __u32 *cls = src_class.lookup(&peer);
    if (!cls) {
        __u16 lport = p.key.sport;
        cls = port_class.lookup(&lport);
    }
    if (cls) {
        __u32 idx = *cls;
        struct class_prio *cp = classes.lookup(&idx);
        if (cp) {
            if (cp->priority)
                skb->priority = cp->priority;
            if (cp->mark)
                skb->mark = cp->mark;
            stat_add(ST_EGRESS_CLASSIFIED, 1);
        }
    }
    return TC_ACT_OK;
}
