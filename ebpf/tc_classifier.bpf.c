/* Sluice TC classifier: per-flow accounting, per-source admission, deny list, rapid-reset,
 * CONTINUATION-flood and PING-flood detection (ingress) and priority-class marking (egress).
 * Compiled by bcc; maps in
 * sluice_maps.h. Attached with direct-action on clsact ingress (sluice_ingress) and egress
 * (sluice_egress).
 *
 * Scope (docs/operating/datapath.md): TC sees packets, not streams. HTTP/2 frames are only
 * visible for cleartext h2c on ports flagged PORT_H2C; TLS traffic is counted per flow only.
 *
 * HTTP/2 frame tracking across segments (RFC 9113 section 4.1: 9-byte frame header, 24-bit
 * length): per flow we keep the sequence number of the next in-order payload byte (next_seq)
 * and how many bytes of the current frame are still to come (skip). An in-order segment is parsed
 * from `skip` on, following frame lengths for at most H2_MAX_FRAMES headers; a frame header split
 * across two segments is carried over (part_len/part_hdr). The choice is conservative: a
 * retransmission (seq before next_seq) is not parsed again (only a tail beyond next_seq is);
 * a gap or more frames than H2_MAX_FRAMES in one skb lose sync (H2_LOST), and counting resumes
 * only at a later segment that *starts* with a plausible frame header (known type, length <=
 * max_frame, reserved bit clear, stream id parity right). Frames are therefore never
 * double-counted, and may be under-counted while unsynced (ST_H2_LOST counts it).
 *
 * Inside an open header block (HEADERS without END_HEADERS, then CONTINUATION) the walker does
 * not let go: an out-of-order segment is dropped (TCP resends it in order) and a block that runs
 * past H2_MAX_FRAMES frames in one skb blocks the flow, so a CONTINUATION flood cannot hide from
 * the max_header_block bound. A client that desynchronises the walker *before* it opens the block
 * (reordered segments, or more than H2_MAX_FRAMES frames in one skb whose next segments never
 * start on a frame boundary) is not seen: the bound is a strong defence against floods, not a
 * proof against a client that shapes its own TCP segments.
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
#define H2_CONTINUATION 0x9
#define H2_MAX_TYPE 0x9
#define H2_FLAG_ACK 0x1         /* SETTINGS, PING */
#define H2_FLAG_END_HEADERS 0x4 /* HEADERS, CONTINUATION */
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

#define H2_PASS 0       /* admit the packet, commit the walker state */
#define H2_DROP 1       /* drop this packet only (out of order inside a header block) */
#define H2_BLOCK 2      /* header block over budget, or one the walker cannot follow: block */
#define H2_BLOCK_PING 3 /* a packet stuffed with PINGs: block */

/* Account one frame header. A header block is a HEADERS frame and the CONTINUATION frames
 * after it, up to the one with END_HEADERS; nothing else may come in between on the connection
 * (RFC 9113 section 6.10), so every byte of it is counted, frame headers included (a flood of
 * empty CONTINUATION frames costs 9 bytes each). The frame's whole length counts as soon as its
 * header is seen. */
static __always_inline void h2_frame(struct h2_walk *w, struct h2_counts *c, __u32 flen,
                                     __u8 type, __u8 flags, __u32 max_hb)
{
    switch (type) {
    case H2_HEADERS: c->headers++; break;
    case H2_DATA: c->data++; break;
    case H2_RST_STREAM: c->rst++; break;
    case H2_SETTINGS: c->settings++; break;
    case H2_PING:
        c->ping++;
        if (!(flags & H2_FLAG_ACK))
            c->ping_req++;
        break;
    default: break;
    }
    if (w->hb_bytes && type != H2_CONTINUATION)
        w->hb_bytes = 0; /* a protocol error the server closes the connection for */
    if (type == H2_HEADERS || (type == H2_CONTINUATION && w->hb_bytes)) {
        w->hb_bytes += 9 + flen;
        if (max_hb && w->hb_bytes > max_hb)
            c->verdict = H2_BLOCK;
        if (flags & H2_FLAG_END_HEADERS)
            w->hb_bytes = 0;
    }
}

static __always_inline void h2_lose(struct h2_walk *w)
{
    w->h2_state = H2_LOST;
    w->part_len = 0;
    w->part_hdr = 0;
    w->hb_bytes = 0;
    stat_add(ST_H2_LOST, 1);
}

/* Parse the frames of one in-order segment into `c`; updates the walker `w` (the caller commits
 * it only if the packet is admitted) and sets c->verdict. Inside an open header block the walker
 * must not lose track (a client could hide a flood behind it): a segment out of order is dropped
 * (TCP retransmits it in order), a frame header split across segments is carried over, and a
 * block that goes on past H2_MAX_FRAMES frames in one packet blocks the flow. */
static __always_inline void h2_parse(struct __sk_buff *skb, struct pkt *p, struct h2_walk *w,
                                     struct h2_counts *c, struct config *cfg)
{
    __u32 len = p->payload_len;
    __u32 end = p->payload_off + len;
    __u32 off = p->payload_off;
    __u32 max_frame = cfg ? cfg->max_frame : 16777215;
    __u32 max_hb = cfg ? cfg->max_header_block : 0;
    if (max_frame == 0)
        max_frame = 16777215;

    if (w->h2_state == H2_SYNCED) {
        __s32 d = (__s32)(p->seq - w->next_seq);
        if (d < 0) { /* retransmission: counted already, except a tail that goes further */
            __u32 old = (__u32)(-d);
            if (old >= len)
                return;
            off += old;
            len -= old;
        } else if (d > 0) { /* gap: we cannot know where frames begin */
            if (w->hb_bytes || w->part_len) {
                c->verdict = H2_DROP;
                return;
            }
            h2_lose(w);
        }
    }
    if (w->h2_state == H2_SYNCED) {
        if (w->part_len) { /* complete a frame header carried from the previous segment */
            __u32 have = w->part_len;
            __u64 acc = w->part_hdr;
            int j;
            for (j = 0; j < 8; j++) {
                if (have >= 9 || off >= end)
                    break;
                __u8 b;
                if (bpf_skb_load_bytes(skb, off, &b, 1) < 0)
                    return;
                if (have < 5)
                    acc = (acc << 8) | b;
                have++;
                off++;
            }
            if (have < 9) { /* still incomplete: the segment was tiny */
                w->part_len = have;
                w->part_hdr = acc;
                w->next_seq = p->seq + p->payload_len;
                return;
            }
            w->part_len = 0;
            w->part_hdr = 0;
            __u32 flen = (__u32)(acc >> 16) & 0xffffff;
            h2_frame(w, c, flen, (__u8)(acc >> 8), (__u8)acc, max_hb);
            w->skip = flen;
        }
        if (w->skip >= end - off) {
            w->skip -= end - off;
            w->next_seq = p->seq + p->payload_len;
            return;
        }
        off += w->skip;
    }
    if (w->h2_state != H2_SYNCED) {
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
        if (w->h2_state == H2_LOST)
            stat_add(ST_H2_RESYNC, 1);
        w->h2_state = H2_SYNCED;
    }

    int i;
    for (i = 0; i < H2_MAX_FRAMES; i++) {
        if (off >= end)
            break;
        __u8 h[9];
        if (off + 9 > end) { /* frame header split across segments: carry its first bytes */
            __u64 acc = 0;
            __u32 have = 0;
            int j;
            for (j = 0; j < 8; j++) {
                if (off >= end)
                    break;
                __u8 b;
                if (bpf_skb_load_bytes(skb, off, &b, 1) < 0) {
                    h2_lose(w);
                    return;
                }
                if (have < 5)
                    acc = (acc << 8) | b;
                have++;
                off++;
            }
            w->part_len = have;
            w->part_hdr = acc;
            break;
        }
        if (bpf_skb_load_bytes(skb, off, h, 9) < 0) {
            h2_lose(w);
            return;
        }
        __u32 flen = ((__u32)h[0] << 16) | ((__u32)h[1] << 8) | h[2];
        h2_frame(w, c, flen, h[3], h[4], max_hb);
        off += 9 + flen;
    }
    if (off < end) { /* more frames than H2_MAX_FRAMES in this skb */
        if (w->hb_bytes) { /* a header block we cannot follow further: no legitimate client
                            * splits one into that many frames */
            c->verdict = H2_BLOCK;
            return;
        }
        if (cfg && cfg->ping_max && c->ping_req * 2 > H2_MAX_FRAMES) {
            /* mostly PINGs, and more to come in this packet than the walker can count: no
             * legitimate client sends that many at once */
            c->verdict = H2_BLOCK_PING;
            return;
        }
        h2_lose(w);
        return;
    }
    w->skip = off - end;
    w->next_seq = p->seq + p->payload_len;
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
        stat_add(fs->blocked == BLOCK_RAPID_RESET ? ST_RR_DROP : ST_FLOOD_DROP, 1);
        return TC_ACT_SHOT;
    }

    if ((flags & PORT_H2C) && p.payload_len > 0) {
        __u32 k0 = 0;
        struct config *cfg = config.lookup(&k0);
        /* The walker works in per-CPU scratch rather than on the stack: the verifier does not
         * track map memory, so frame counts stay unknown scalars and its states prune (on the
         * stack, every combination of counts is a state of its own and the program no longer
         * verifies). */
        struct h2_scratch *sc = scratch.lookup(&k0);
        if (!sc)
            return TC_ACT_OK;
        __builtin_memset(sc, 0, sizeof(*sc));
        sc->w.next_seq = fs->next_seq;
        sc->w.skip = fs->skip;
        sc->w.h2_state = fs->h2_state;
        sc->w.hb_bytes = fs->hb_bytes;
        sc->w.part_len = fs->part_len;
        sc->w.part_hdr = fs->part_hdr;
        h2_parse(skb, &p, &sc->w, &sc->c, cfg);
        struct h2_walk st = sc->w;
        struct h2_counts c = sc->c;
        if (c.verdict == H2_DROP) { /* state not committed: the retransmission comes in order */
            stat_add(ST_H2_OOO_DROP, 1);
            return TC_ACT_SHOT;
        }

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
        fs->hb_bytes = st.hb_bytes;
        fs->part_len = st.part_len;
        fs->part_hdr = st.part_hdr;
        fs->headers += c.headers;
        fs->data += c.data;
        fs->rst_stream += c.rst;
        fs->settings += c.settings;
        fs->ping += c.ping;

        /* CONTINUATION flood (CVE-2024-27316 family): grpc rejects the stream at its metadata
         * cap but keeps reading and parsing the header block for as long as it goes on. */
        if (c.verdict == H2_BLOCK) {
            fs->blocked = BLOCK_HEADER_BLOCK;
            stat_add(ST_HB_FLOWS, 1);
            stat_add(ST_FLOOD_DROP, 1);
            return TC_ACT_SHOT;
        }
        /* PING flood (CVE-2019-9512): every PING costs the server an answer, even after its
         * GOAWAY, and a client that does not read never lets that GOAWAY through. */
        if (cfg && cfg->ping_max && c.ping_req) {
            if (now - fs->ping_win_start_ns > cfg->ping_window_ns) {
                fs->ping_win_start_ns = now;
                fs->win_ping = 0;
            }
            fs->win_ping += c.ping_req;
            if (fs->win_ping > cfg->ping_max || c.verdict == H2_BLOCK_PING) {
                fs->blocked = BLOCK_PING_FLOOD;
                stat_add(ST_PING_FLOWS, 1);
                stat_add(ST_FLOOD_DROP, 1);
                return TC_ACT_SHOT;
            }
        }

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
                fs->blocked = BLOCK_RAPID_RESET;
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
