import base64, json
async def test_probe(api):
    a, b = api.a, api.b
    r = await a.post("/v1/conversations", json={"title": "x"})
    cid = r.json()["id"]
    for w, o in [("2020-01-01T00:00:00+00:00", {"00000000-0000-0000-0000-000000000001": 10**30}), ("9999-12-31T23:59:59+14:00", {}), ("0001-01-01T00:00:00-10:00", {})]:
        cur = base64.urlsafe_b64encode(json.dumps({"w": [w, "00000000-0000-0000-0000-000000000000"], "o": o}).encode()).decode()
        async with a.stream("GET", f"/v1/conversations/{cid}/events", params={"cursor": cur}) as r:
            print("cursor", w, r.status_code, r.headers)
            body = await r.aread()
            print(body[:500])
    print(api.daemon.log_text()[-6000:])
